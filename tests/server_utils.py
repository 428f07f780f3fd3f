"""Helpers for server tests: ``halserve serve`` run as a real subprocess on 127.0.0.1
(a free port), torn down with SIGTERM, and the main test server's settings."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

# The main server's settings (tests read them back to build bad inputs).
MAX_MODEL_LEN = 128
VOCAB_SIZE = 512
SERVED_NAME = "tiny-llama"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``halserve serve`` in a subprocess; ``url`` once /health answers 200."""

    def __init__(self, args: list[str], log_path: str, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "halserve.entrypoints.cli", "serve", *args,
               "--host", "127.0.0.1", "--port", str(self.port)]
        self.log_path = log_path
        self._log = open(log_path, "wb")
        full_env = {**os.environ, "HALSERVE_CPU_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout: float = 180.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()}")

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode

def server_args(checkpoint: str, *extra: str) -> list[str]:
    return [
        checkpoint, "--platform", "cpu", "--served-model-name", SERVED_NAME,
        "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "512", "--block-size", "16",
        "--log-level", "warning", *extra,
    ]


def requests_finished_by(api_server) -> float:
    """halserve:request_success_total as one API server's own multiprocess metrics file holds it
    (``--api-server-count``; ``api_server`` a psutil.Process)."""
    from prometheus_client.mmap_dict import MmapedDict

    path = os.path.join(api_server.environ()["PROMETHEUS_MULTIPROC_DIR"], f"counter_{api_server.pid}.db")
    return sum(value for key, value, *_ in MmapedDict.read_all_values_from_file(path)
               if '"halserve:request_success"' in key)

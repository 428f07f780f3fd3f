"""`halserve serve` startup failures: fast, clear, exit codes (no model is loaded)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')


def serve(*args: str, timeout: float = 60) -> tuple[int, str, float]:
    start = time.monotonic()
    from server_utils import free_port

    cmd = [sys.executable, "-m", "halserve.entrypoints.cli", "serve", *args]
    if "--port" not in args:
        cmd += ["--host", "127.0.0.1", "--port", str(free_port())]
    proc = subprocess.Popen(cmd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # it started serving: stop it and everything it spawned
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"halserve serve {' '.join(args)} did not fail:\n{out}") from None
    return proc.returncode, out, time.monotonic() - start


def test_unavailable_platform_fails_fast_with_the_probe_reason(checkpoint):
    rc, out, elapsed = serve(checkpoint, "--platform", "rocm")
    assert rc == 1 and elapsed < 30
    assert "rocm" in out and "not available" in out and "torch.version.hip is None" in out


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--pipeline-parallel-size", "0"], "--pipeline-parallel-size: Input should be greater than or equal to 1"),
        (["--distributed-executor-backend", "nope"], "no such executor"),
        (["--quantization", "no-such-quant"], "no quantization method"),
        (["--attention-backend", "no-such-backend"], "no attention backend"),
        (["--block-size", "3"], "power of two"),
        (["--dtype", "int3"], "dtype"),
        (["--chat-template", "/no/such/file.jinja"], "no such file"),
        (["--chat-template", "{{ bad jinja {% for %}"], "not a valid Jinja template: expected token"),
        (["--kv-cache-memory", "lots"], "invalid size"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
        (["--tool-call-parser", "nope"], "unknown tool-call parser 'nope'; the parsers are: deepseek_v3, hermes, "
                                         "llama3_json, mistral, pythonic, qwen3_coder"),
        (["--tool-parser-plugin", "/no/such/parsers.py"], "--tool-parser-plugin /no/such/parsers.py: no such file"),
        (["--reasoning-parser", "nope"], "unknown reasoning parser 'nope'; the parsers are: deepseek_r1, qwen3"),
        (["--pooler-config", '{"pooling_type": "MAX"}'], "pooling_type must be one of LAST, MEAN, CLS, got 'MAX'"),
        (["--override-pooler-config", '{"normalize": 1}'], "normalize must be true or false, got 1"),
        (["--pooler-config", '{"pooling": "MEAN"}'], "has no field 'pooling'; its fields are pooling_type, normalize"),
        (["--pooler-config", "MEAN"], "pooler config is not valid JSON"),
        (["--limit-mm-per-prompt", '{"video": 1}'], "--limit-mm-per-prompt: limit_mm_per_prompt: 'video' inputs"),
        (["--limit-mm-per-prompt", "image=2"], "limit_mm_per_prompt must be JSON"),
        (["--kv-transfer-config", '{"kv_connector": "Nope"}'], "unknown kv_connector 'Nope'; registered KV connectors: "
                                                              "SharedStorageConnector, OffloadingConnector"),
        (["--kv-transfer-config", '{"kv_connector": "OffloadingConnector", "kv_ip": 3}'], "kv_ip: Input should be"),
        (["--kv-transfer-config", "{"], "kv_transfer_config is not valid JSON"),
        (["--kv-offloading-size", "0"], "--kv-offloading-size: Input should be greater than 0"),
        (["--kv-offloading-size", "1", "--kv-transfer-config", '{"kv_connector": "OffloadingConnector"}'],
         "kv_offloading_size and kv_transfer_config both ask for a KV connector"),
    ],
)
def test_unsupported_or_invalid_flags_exit_2(checkpoint, flags, expected):
    rc, out, _ = serve(checkpoint, "--platform", "cpu", *flags)
    assert rc == 2, out
    assert expected in out


def test_help_lists_groups_and_defaults():
    proc = subprocess.run([sys.executable, "-m", "halserve.entrypoints.cli", "serve", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    for text in ("server:", "scheduler and KV cache:", "--enable-prefix-caching", "(default: 8000)", "--api-key"):
        assert text in proc.stdout

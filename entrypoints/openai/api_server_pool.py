"""``halserve serve --api-server-count N``: N API-server processes on one port, one engine core.

    launcher (this process)
      |- binds the port N times (SO_REUSEPORT): one listening socket per API server, so the
      |  kernel spreads new connections over them (one shared socket would hand a burst of
      |  connections to whichever server woke first)
      |- engine-core process (core_proc.py): one Unix socket, one connection per API server
      '- API server 0..N-1: uvicorn on its socket, each an ``AsyncLLM`` over an ``MPEngineCoreClient``

Metrics: the per-request counters and histograms are in Prometheus multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR``, a temporary directory), so whichever server a scrape reaches sums
them over all servers; the engine's gauges come from the engine itself (each server holds its
latest stats). SIGTERM/SIGINT go on to the API servers, which drain; the engine then exits as
its last client leaves. If the engine or any API server dies, the others are stopped and the
launcher exits 1.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig
    from halserve.models.loader import ModelInfo

logger = logging.getLogger("halserve.serve")

__all__ = ["run_api_servers"]

STOP_TIMEOUT_S = 15.0


def run_api_servers(args: argparse.Namespace, config: EngineConfig, served: list[str], model: str,
                    chat_template: str | None) -> int:
    import multiprocessing
    from multiprocessing.connection import wait

    from halserve.engine.core_client import spawn_engine_core
    from halserve.entrypoints.cli_serve import engine_log_level, report_load_failure

    metrics_dir = tempfile.mkdtemp(prefix="halserve-prometheus-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # (inherited by the API servers)
    try:
        listeners = [_bind(args.host, args.port) for _ in range(args.api_server_count)]
    except OSError as exc:
        print(f"halserve serve: error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    try:
        engine, socket_path, model_info = spawn_engine_core(config, engine_log_level(args))
    except Exception as exc:  # noqa: BLE001 - report and exit
        return report_load_failure(exc, model)
    ctx = multiprocessing.get_context("spawn")
    servers = [
        ctx.Process(target=_api_server_main, name=f"halserve-api-server-{i}",
                    args=(args, config, served, model, chat_template, socket_path, model_info, listeners[i]))
        for i in range(args.api_server_count)
    ]
    for server in servers:
        server.start()
    for listener in listeners:
        listener.close()
    stopping: list[int] = []

    def forward(sig: int, _: Any) -> None:
        stopping.append(sig)
        for server in servers:
            if server.is_alive():
                os.kill(server.pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    failed = False
    try:
        alive = {server.sentinel: server for server in servers}
        while alive:
            ready = wait([*alive, engine.sentinel], timeout=1.0)
            for sentinel in ready:  # (a closed sentinel comes a moment before the exit status)
                (alive.get(sentinel) or engine).join(5)
            if engine.sentinel in ready and not stopping:
                logger.error("the engine-core process exited with code %s", engine.exitcode)
                failed = True
            for sentinel in ready:
                server = alive.pop(sentinel, None)
                if server is not None and (server.exitcode != 0 or not stopping):
                    logger.error("%s exited with code %s", server.name, server.exitcode)
                    failed = True
            if failed and not stopping:
                forward(signal.SIGTERM, None)
            if engine.sentinel in ready and alive:
                for server in alive.values():  # (they exit 1 on their own within seconds)
                    server.join(STOP_TIMEOUT_S)
                alive.clear()
        engine.join(STOP_TIMEOUT_S)  # (its last client is gone: it exits)
        if engine.is_alive():
            engine.terminate()
            engine.join(5)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for proc in [*servers, engine]:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        shutil.rmtree(os.path.dirname(socket_path), ignore_errors=True)
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return 1 if failed or engine.exitcode not in (0, None) else 0


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _api_server_main(args: argparse.Namespace, config: EngineConfig, served: list[str], model: str,
                     chat_template: str | None, socket_path: str, model_info: ModelInfo, listener: socket.socket) -> None:
    """One API server (a spawned process): connect to the engine, serve HTTP on ``listener``."""
    # A stop asked for before uvicorn takes the signals over (it restores this one after) is a clean exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(levelname)s %(name)s: %(message)s")
    from halserve.engine.async_llm import AsyncLLM
    from halserve.engine.core_client import MPEngineCoreClient
    from halserve.entrypoints.cli_serve import load_lora_modules, report_load_failure, serve_http

    try:
        engine = AsyncLLM.from_client(config, MPEngineCoreClient(socket_path, model_info))
        lora_modules = load_lora_modules(args, engine, served)
    except Exception as exc:  # noqa: BLE001 - report and exit
        raise SystemExit(report_load_failure(exc, model)) from None
    raise SystemExit(serve_http(args, engine, served, model, chat_template, lora_modules, sock=listener))

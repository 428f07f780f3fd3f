"""``halserve serve``'s process layout: the API server and a separate engine-core process; what
happens when either dies or is told to stop; ``--api-server-count`` (several API servers, one
engine, metrics summed)."""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import psutil
import pytest
from server_utils import SERVED_NAME, ServerProcess, requests_finished_by, server_args

pytestmark = pytest.mark.slow  # starts servers and kills their processes (inner loop: -m 'not slow')


@pytest.fixture(scope="module")
def slow_checkpoint(tmp_path_factory) -> str:
    """Big enough that a long stream is still running when a test kills something."""
    from model_factory import make_checkpoint

    return make_checkpoint(str(tmp_path_factory.mktemp("slow_llama")), "llama", vocab_size=512, hidden_size=256,
                           num_layers=4, intermediate_size=512, max_position_embeddings=2048)


def _args(checkpoint: str, *extra: str) -> list[str]:
    args = server_args(checkpoint, *extra)
    i = args.index("--max-model-len")
    args[i + 1] = "2048"
    return args


def _engine_process(server: ServerProcess) -> psutil.Process:
    children = psutil.Process(server.proc.pid).children(recursive=True)
    engines = [c for c in children if "halserve.engine.core_proc" in " ".join(c.cmdline())
               or _spawned_target(c) == "engine"]
    assert len(engines) == 1, [c.cmdline() for c in children]
    return engines[0]


def _spawned_target(proc: psutil.Process) -> str | None:
    """multiprocessing spawn children all run ``spawn_main``; the engine core is the one whose
    parent is the server and that holds the engine's Unix socket."""
    try:
        sockets = proc.net_connections(kind="unix")
    except (psutil.AccessDenied, psutil.NoSuchProcess):
        return None
    return "engine" if any(s.laddr.endswith("core.sock") for s in sockets) else None


def _stream(url: str, max_tokens: int, events: list, started: threading.Event) -> None:
    body = {"model": SERVED_NAME, "prompt": "hello", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line:
                    events.append(line)
                    started.set()
    except httpx.HTTPError as exc:
        events.append(f"transport error: {exc!r}")
    started.set()


def _start_stream(url: str) -> tuple[list[str], threading.Thread]:
    """A long stream in a thread, once its first event has arrived: (its events so far, the thread)."""
    events: list[str] = []
    started = threading.Event()
    reader = threading.Thread(target=_stream, args=(url, 1900, events, started))
    reader.start()
    assert started.wait(60)
    return events, reader


def test_engine_core_runs_in_its_own_process(checkpoint, tmp_path):
    srv = ServerProcess(server_args(checkpoint), str(tmp_path / "tree.log")).wait_ready()
    try:
        engine = _engine_process(srv)
        assert engine.pid != srv.proc.pid and engine.ppid() == srv.proc.pid
        out = httpx.post(srv.url + "/v1/completions", json={"model": SERVED_NAME, "prompt": "hi", "max_tokens": 3},
                         timeout=60).json()
        assert out["usage"]["completion_tokens"] == 3
    finally:
        assert srv.stop() == 0
    assert not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE


def test_disable_frontend_multiprocessing_keeps_one_process(checkpoint, tmp_path):
    srv = ServerProcess(server_args(checkpoint, "--disable-frontend-multiprocessing"),
                        str(tmp_path / "inproc.log")).wait_ready()
    try:
        children = psutil.Process(srv.proc.pid).children(recursive=True)
        assert not any(_spawned_target(c) == "engine" for c in children)
        out = httpx.post(srv.url + "/v1/completions", json={"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2},
                         timeout=60).json()
        assert out["usage"]["completion_tokens"] == 2
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_engine_death_fails_streams_turns_health_503_and_exits_nonzero(slow_checkpoint, tmp_path, sig):
    srv = ServerProcess(_args(slow_checkpoint), str(tmp_path / "death.log")).wait_ready()
    try:
        engine = _engine_process(srv)
        events, reader = _start_stream(srv.url)
        killed = time.monotonic()
        os.kill(engine.pid, sig)
        saw_503 = False
        while srv.proc.poll() is None and time.monotonic() - killed < 5:
            try:
                saw_503 |= httpx.get(srv.url + "/health", timeout=1).status_code == 503
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        reader.join(10)
        assert srv.proc.wait(5 - (time.monotonic() - killed) + 1) != 0
        assert time.monotonic() - killed < 6
        assert saw_503
        assert events[-1] == "data: [DONE]", events[-3:]
        error = json.loads(events[-2].removeprefix("data: "))
        assert error["error"]["code"] == "engine_dead" and error["error"]["type"]
        assert re.search(r"engine", error["error"]["message"])
    finally:
        srv.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_mid_stream_exits_zero_and_leaves_no_process(slow_checkpoint, tmp_path, sig):
    srv = ServerProcess(_args(slow_checkpoint), str(tmp_path / "term.log")).wait_ready()
    engine = _engine_process(srv)
    family = [engine, *psutil.Process(srv.proc.pid).children(recursive=True)]
    events, reader = _start_stream(srv.url)
    start = time.monotonic()
    srv.proc.send_signal(sig)
    assert srv.proc.wait(15) == 0
    assert time.monotonic() - start < 10
    srv.stop()
    reader.join(10)
    assert events[-1] == "data: [DONE]"
    assert '"finish_reason":"abort"' in events[-2].replace(" ", "")
    gone, alive = psutil.wait_procs(family, timeout=5)
    assert not alive, [p.cmdline() for p in alive]


def test_sigterm_to_the_process_group_exits_zero(slow_checkpoint, tmp_path):
    """systemd, `kill -- -PGID`: every process gets SIGTERM at once. The engine core's is handled first
    here (the order that raced: the server took the engine's exit for its death and exited 1)."""
    srv = ServerProcess(_args(slow_checkpoint), str(tmp_path / "group.log")).wait_ready()
    engine = _engine_process(srv)
    family = [engine, *psutil.Process(srv.proc.pid).children(recursive=True)]
    events, reader = _start_stream(srv.url)
    start = time.monotonic()
    os.kill(engine.pid, signal.SIGTERM)
    # the widest form of the race: the server's own signal lands after it heard the engine stop
    # (or, where the engine does not say so, after the engine is gone)
    deadline = time.monotonic() + 5
    while "engine core stopped" not in srv.log() and engine.is_running() and time.monotonic() < deadline:
        time.sleep(0.01)
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(15) == 0, srv.log()[-2000:]
    assert time.monotonic() - start < 10
    srv.stop()
    reader.join(10)
    assert events[-1] == "data: [DONE]"
    assert "the engine died" not in srv.log()
    gone, alive = psutil.wait_procs(family, timeout=5)
    assert not alive, [p.cmdline() for p in alive]


def test_killed_api_server_takes_the_engine_with_it(checkpoint, tmp_path):
    srv = ServerProcess(server_args(checkpoint), str(tmp_path / "kill.log")).wait_ready()
    engine = _engine_process(srv)
    family = psutil.Process(srv.proc.pid).children(recursive=True)
    srv.proc.kill()
    srv.proc.wait(5)
    gone, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, [p.cmdline() for p in alive]
    assert engine in gone
    srv.stop()


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_api_server_count_shares_the_port_and_one_engine(checkpoint, tmp_path):
    srv = ServerProcess(server_args(checkpoint, "--api-server-count", "2"), str(tmp_path / "multi.log")).wait_ready()
    try:
        children = [c for c in psutil.Process(srv.proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        engines = [c for c in children if _spawned_target(c) == "engine"]
        assert len(engines) == 1 and len(children) == 3, [c.cmdline() for c in children]  # engine, 2 API servers
        num_requests = 24

        def complete(i: int) -> None:  # (a connection each, several at once: both servers take some)
            out = httpx.post(srv.url + "/v1/completions", headers={"Connection": "close"}, timeout=60,
                             json={"model": SERVED_NAME, "prompt": f"hi {i}", "max_tokens": 2}).json()
            assert out["usage"]["completion_tokens"] == 2

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(complete, range(num_requests)))
        api_servers = [c for c in children if c not in engines]
        served = [requests_finished_by(p) for p in api_servers]
        assert sum(served) == num_requests and all(served), served
        with httpx.Client(timeout=60) as client:
            for _ in range(4):  # whichever server answers, the sums are the same
                text = client.get(srv.url + "/metrics", headers={"Connection": "close"}).text
                assert _metric(text, "halserve:generation_tokens_total") == 2 * num_requests
                assert _metric(text, 'halserve:request_success_total') == num_requests
                assert _metric(text, "halserve:num_requests_running") == 0
                assert _metric(text, "halserve:kv_cache_usage_perc") == 0
    finally:
        family = psutil.Process(srv.proc.pid).children(recursive=True)
        assert srv.stop() == 0
    gone, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, [p.cmdline() for p in alive]


def test_worker_death_fails_streams_and_exits_nonzero(slow_checkpoint, tmp_path):
    """With two pipeline stages (the mp executor), killing a worker ends the engine core, and the
    server reports it as the engine's death."""
    srv = ServerProcess(_args(slow_checkpoint, "--pipeline-parallel-size", "2"),
                        str(tmp_path / "worker.log")).wait_ready()
    try:
        engine = _engine_process(srv)
        workers = [c for c in engine.children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(workers) == 2, [c.cmdline() for c in engine.children()]
        events, reader = _start_stream(srv.url)
        killed = time.monotonic()
        workers[1].kill()
        assert srv.proc.wait(10) != 0
        assert time.monotonic() - killed < 6
        reader.join(10)
        assert events[-1] == "data: [DONE]", events[-3:]
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "engine_dead"
        gone, alive = psutil.wait_procs([engine, *workers], timeout=10)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        srv.stop()


def test_idle_worker_death_is_noticed(checkpoint, tmp_path):
    srv = ServerProcess(server_args(checkpoint, "--pipeline-parallel-size", "2"),
                        str(tmp_path / "idle.log")).wait_ready()
    try:
        engine = _engine_process(srv)
        worker = next(c for c in engine.children() if "spawn_main" in " ".join(c.cmdline()))
        killed = time.monotonic()
        worker.kill()
        assert srv.proc.wait(10) != 0
        assert time.monotonic() - killed < 5
        assert "is not running" in srv.log()
    finally:
        srv.stop()


@pytest.mark.parametrize("flags, message", [
    (["--api-server-count", "0"], "--api-server-count 0: must be at least 1"),
    (["--api-server-count", "2", "--disable-frontend-multiprocessing"], "drop --disable-frontend-multiprocessing"),
])
def test_process_flags_are_checked(flags, message, capsys):
    from halserve.entrypoints.cli import main

    assert main(["serve", "--platform", "cpu", *flags]) == 2
    assert message in capsys.readouterr().err

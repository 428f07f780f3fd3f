"""No single request freezes the server: while a 10 MB ``/detokenize`` (5,000,000 ids) and a 24 MB
batch of 3,000 token-id prompts are parsed, checked and decoded, ``/health`` answers within
100 ms and a concurrent stream's largest gap between events stays under 200 ms (plus, on a
shared machine, the worst latency the same probes saw with no big request in flight)."""
from __future__ import annotations

import random
import subprocess
import sys
import time

import httpx
import pytest
from server_utils import SERVED_NAME, VOCAB_SIZE, ServerProcess, server_args

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')

HEALTH_LIMIT_S = 0.1
STREAM_GAP_LIMIT_S = 0.2


@pytest.fixture(scope="module")
def long_context_server(tmp_path_factory):
    from model_factory import make_checkpoint

    path = make_checkpoint(str(tmp_path_factory.mktemp("long_llama")), "llama", vocab_size=VOCAB_SIZE,
                           max_position_embeddings=4096)
    args = server_args(path)
    args[args.index("--max-model-len") + 1] = "4096"
    srv = ServerProcess(args, str(tmp_path_factory.mktemp("logs") / "loop.log")).wait_ready()
    yield srv
    srv.stop()


# The probes run in processes of their own, so the test's own threads (sending 34 MB) do not
# delay them: each prints its worst latency (seconds) and how many it measured when stdin closes.
_HEALTH_PROBE = """
import sys, threading, time, httpx
url = sys.argv[1]; worst = 0.0; count = 0; stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
with httpx.Client(timeout=5) as client:
    while not stop.is_set():
        start = time.perf_counter()
        assert client.get(url + "/health").status_code == 200
        took = time.perf_counter() - start; count += 1
        worst = max(worst, took)
        time.sleep(0.02)
print(worst, count)
"""
_STREAM_PROBE = """
import sys, threading, time, httpx
url, model = sys.argv[1], sys.argv[2]; worst = 0.0; count = 0; stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
body = {"model": model, "prompt": "hello", "max_tokens": 4000, "stream": True, "ignore_eos": True}
with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
    last = None
    for line in response.iter_lines():
        now = time.perf_counter()
        if not line:
            continue
        if last is not None:
            worst = max(worst, now - last); count += 1
            if count == 1:
                print("started", flush=True)
        last = now
        if stop.is_set():
            break
print(worst, count)
"""


def _probe(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def _result(probe: subprocess.Popen) -> tuple[float, int]:
    out, _ = probe.communicate("", timeout=60)
    worst, count = out.split()[-2:]
    return float(worst), int(count)


def test_big_requests_do_not_stall_health_or_streams(long_context_server):
    url = long_context_server.url
    rng = random.Random(0)
    # 5,000,000 one-digit ids: a 10 MB body
    detok_body = (f'{{"model": "{SERVED_NAME}", "tokens": [' + ",".join(["7"] * 5_000_000) + "]}").encode()
    # 3,000 prompts of 2,048 three-digit ids: a 24 MB body; the last id is past the vocabulary, so
    # every prompt is parsed and checked, then the batch is refused (a 400) without running any
    prompts = [[rng.randrange(100, VOCAB_SIZE) for _ in range(2048)] for _ in range(3000)]
    prompts[-1][-1] = VOCAB_SIZE
    batch_body = (f'{{"model": "{SERVED_NAME}", "max_tokens": 1, "prompt": ['
                  + ",".join("[" + ",".join(map(str, p)) + "]" for p in prompts) + "]}").encode()
    assert len(detok_body) > 10_000_000 and len(batch_body) > 24_000_000

    # A shared VM's own hiccups (its vCPUs descheduled by the host for 100+ ms, seen once in a CI run whose
    # every request took 40-60% longer than usual) can land inside the one loaded window: a window over the
    # bounds is measured once more, and the test fails only if both are. A server that stalls on the big
    # requests fails both (they take 2-9 s and the probes sample every 20 ms).
    ok, first = _measure_once(url, detok_body, batch_body)
    if not ok:
        ok, second = _measure_once(url, detok_body, batch_body)
        assert ok, f"over the bounds in both windows: {first}; {second}"


def _measure_once(url: str, detok_body: bytes, batch_body: bytes) -> tuple[bool, str]:
    """One window: the probes with no big request in flight (the machine's own noise, CI machines are shared),
    then with both big requests; whether the issue's bounds held (plus that noise), and the figures."""
    stream = _probe(_STREAM_PROBE, url, SERVED_NAME)
    assert stream.stdout.readline().strip() == "started"
    health = _probe(_HEALTH_PROBE, url)
    time.sleep(8)  # (about as long as the big requests take)
    quiet_health, _ = _result(health)
    quiet_gap, _ = _result(stream)

    stream = _probe(_STREAM_PROBE, url, SERVED_NAME)
    assert stream.stdout.readline().strip() == "started"
    health = _probe(_HEALTH_PROBE, url)
    time.sleep(0.5)
    try:
        headers = {"Content-Type": "application/json"}
        with httpx.Client(timeout=120) as client:
            start = time.perf_counter()
            detok = client.post(url + "/detokenize", content=detok_body, headers=headers)
            detok_s = time.perf_counter() - start
            start = time.perf_counter()
            batch = client.post(url + "/v1/completions", content=batch_body, headers=headers)
            batch_s = time.perf_counter() - start
        time.sleep(0.3)
    finally:
        worst_health, num_probes = _result(health)
        worst_gap, num_events = _result(stream)
    assert detok.status_code == 200 and len(detok.json()["prompt"]) >= 5_000_000 // 2
    assert batch.status_code == 400 and "prompt[2999]" in batch.text, batch.text[:300]
    report = (f"detokenize {detok_s:.2f}s, 24 MB batch {batch_s:.2f}s; /health max {worst_health * 1e3:.0f} ms "
              f"over {num_probes} probes; stream max gap {worst_gap * 1e3:.0f} ms over {num_events} events "
              f"(quiet: /health {quiet_health * 1e3:.0f} ms, stream gap {quiet_gap * 1e3:.0f} ms)")
    print(report)
    assert num_probes > 10 and num_events > 10
    # The bounds; a machine that is itself this noisy when quiet gets its own noise on top.
    ok = worst_health < HEALTH_LIMIT_S + quiet_health and worst_gap < STREAM_GAP_LIMIT_S + quiet_gap
    return ok, report

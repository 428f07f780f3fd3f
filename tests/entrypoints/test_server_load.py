"""Concurrency, client disconnects, metrics consistency, SIGTERM under load."""
from __future__ import annotations

import asyncio
import re
import signal
import time

import httpx
import psutil
import pytest
from server_utils import SERVED_NAME, VOCAB_SIZE, ServerProcess, server_args

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')

PROMPTS = ["the quick brown fox", "tell me about paris", "hello world model", "once upon a time", "red green blue"]


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` as {"name{labels}": value} (label model_name dropped)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, value = line.rsplit(" ", 1)
        key = re.sub(r',?model_name="[^"]*"', "", key).replace("{,", "{").replace("{}", "")
        values[key] = float(value)
    return values


def wait_idle(url: str, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if m["halserve:num_requests_running"] == 0 and m["halserve:num_requests_waiting"] == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout}s: {m}")
        time.sleep(0.2)


def test_64_concurrent_streams_and_32_disconnects(server, client, async_client_factory):
    idle_kv = wait_idle(server.url)["halserve:kv_cache_usage_perc"]
    max_tokens = 24
    expected = {
        p: client.completions.create(model=SERVED_NAME, prompt=p, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
        for p in PROMPTS
    }

    async def one(i: int, aclient) -> tuple[int, str | None]:
        prompt = PROMPTS[i % len(PROMPTS)]
        close_early = i % 2 == 1
        stream = await aclient.completions.create(
            model=SERVED_NAME, prompt=prompt, max_tokens=max_tokens if not close_early else 120,
            temperature=0, stream=True, extra_body={"ignore_eos": True},
        )
        text = ""
        async for chunk in stream:
            text += chunk.choices[0].text
            if close_early and text:
                await stream.close()  # the client goes away mid-stream
                return i, None
        return i, text

    async def main():
        aclient = async_client_factory()
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i, aclient) for i in range(64))), 240)
        finally:
            await aclient.close()

    results = asyncio.run(main())
    completed = [(i, text) for i, text in results if text is not None]
    assert len(completed) == 32
    for i, text in completed:
        assert text == expected[PROMPTS[i % len(PROMPTS)]]
    # the 32 closed streams were aborted: nothing left running, KV cache back to idle
    after = wait_idle(server.url)
    assert after["halserve:kv_cache_usage_perc"] == pytest.approx(idle_kv, abs=1e-9)
    assert after['halserve:request_success_total{finished_reason="abort"}'] >= 32


@pytest.fixture(scope="module")
def long_server(checkpoint, tmp_path_factory):
    """A server of the tiny model with room for 500-token answers (the shared one stops at 128)."""
    args = server_args(checkpoint, "--max-model-len", "512", "--num-kv-blocks", "2112")  # (the last value wins)
    srv = ServerProcess(args, str(tmp_path_factory.mktemp("logs") / "long_server.log")).wait_ready()
    yield srv
    srv.stop()


def test_non_streaming_disconnect_aborts(long_server):
    # 64 prompts x 500 tokens keep the server busy; the client goes away once all 64 are queued (a client
    # gone while the batch is still being queued stops the queueing, so fewer would be aborted then). The API
    # server queues a batch's prompts over ~1 s on 2 busy cores, and 120-token answers (the shared server's
    # limit) began to finish before the last was queued once decode got faster: 500 tokens leave seconds.
    server, num, max_tokens = long_server, 64, 500
    body = {"model": SERVED_NAME, "prompt": ["hello world"] * num, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    key = 'halserve:request_success_total{finished_reason="abort"}'
    before = wait_idle(server.url)

    async def post_then_leave():
        async with httpx.AsyncClient(timeout=60) as aclient:
            post = asyncio.ensure_future(aclient.post(server.url + "/v1/completions", json=body))
            deadline = time.monotonic() + 20
            while True:
                m = await asyncio.to_thread(scrape, server.url)
                if m["halserve:num_requests_running"] + m["halserve:num_requests_waiting"] >= num:
                    break
                assert not post.done(), "the batch finished before all of it was seen queued"
                assert time.monotonic() < deadline, f"the batch was never all queued: {m}"
                await asyncio.sleep(0.02)
            post.cancel()  # the connection closes: the client is gone
            with pytest.raises(asyncio.CancelledError):
                await post

    asyncio.run(post_then_leave())
    # Every request of the batch ends: aborted, or (a request whose last tokens the engine, in its own
    # process, produced before the abort reached it, on a loaded machine) finished by length.
    length = 'halserve:request_success_total{finished_reason="length"}'
    deadline = time.monotonic() + 20
    def ended(m: dict[str, float]) -> float:
        return m.get(key, 0.0) + m.get(length, 0.0)

    while ended(m := scrape(server.url)) < ended(before) + num:
        assert time.monotonic() < deadline, f"the abandoned requests did not end: {m}"
        time.sleep(0.1)
    after = wait_idle(server.url)
    assert ended(after) - ended(before) == num
    assert after[key] - before.get(key, 0.0) >= num // 2, "most of the abandoned requests should have been aborted"
    assert after["halserve:kv_cache_usage_perc"] == pytest.approx(before["halserve:kv_cache_usage_perc"], abs=1e-9)
    assert after["halserve:generation_tokens_total"] - before["halserve:generation_tokens_total"] < num * max_tokens


def test_metrics_agree_with_a_known_workload(server, client):
    before = wait_idle(server.url)
    returned = prompt_tokens = 0
    for i, p in enumerate(PROMPTS):
        out = client.completions.create(model=SERVED_NAME, prompt=p, max_tokens=3 + i, temperature=0,
                                        extra_body={"ignore_eos": True})
        returned += out.usage.completion_tokens
        prompt_tokens += out.usage.prompt_tokens
    stream = client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "hi"}],
                                            max_completion_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    usage = [c.usage for c in stream if c.usage][-1]
    returned += usage.completion_tokens
    prompt_tokens += usage.prompt_tokens
    after = wait_idle(server.url)
    n = len(PROMPTS) + 1

    def delta(key):
        return after[key] - before[key]

    assert delta("halserve:generation_tokens_total") == returned
    assert delta("halserve:prompt_tokens_total") == prompt_tokens
    assert delta("halserve:time_to_first_token_seconds_count") == n
    assert delta("halserve:e2e_request_latency_seconds_count") == n
    assert delta('halserve:request_success_total{finished_reason="length"}') == n
    assert delta("halserve:inter_token_latency_seconds_count") == returned - n
    assert delta("halserve:prefix_cache_queries_total") >= 0 and "halserve:num_preemptions_total" in after


def test_sigterm_under_load_exits_zero_quickly(checkpoint, tmp_path):
    srv = ServerProcess(server_args(checkpoint), str(tmp_path / "sigterm.log")).wait_ready()
    proc = psutil.Process(srv.proc.pid)
    children = proc.children(recursive=True)
    body = {"model": SERVED_NAME, "prompt": "hello world", "max_tokens": 120, "temperature": 0,
            "ignore_eos": True, "stream": True}
    finish_reasons: list = []

    async def one(aclient: httpx.AsyncClient):
        reason = None
        try:
            async with aclient.stream("POST", srv.url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        import json

                        choices = json.loads(line[6:]).get("choices") or []
                        if choices and choices[0].get("finish_reason"):
                            reason = choices[0]["finish_reason"]
        except httpx.HTTPError:
            reason = "connection closed"
        finish_reasons.append(reason)

    async def main():
        async with httpx.AsyncClient(timeout=60) as aclient:
            tasks = [asyncio.create_task(one(aclient)) for _ in range(16)]
            deadline = time.monotonic() + 60
            while scrape(srv.url)["halserve:num_requests_running"] < 1:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            start = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            rc = await asyncio.get_running_loop().run_in_executor(None, srv.proc.wait, 30)
            elapsed = time.monotonic() - start
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            return rc, elapsed

    try:
        rc, elapsed = asyncio.run(main())
    finally:
        srv.stop()
    assert rc == 0, srv.log()
    assert elapsed < 10
    assert len(finish_reasons) == 16 and "abort" in finish_reasons
    # every child ends with the server: the engine core and the parse worker are joined before it
    # exits; multiprocessing's resource tracker ends when its pipe closes, a moment after the server
    _, alive = psutil.wait_procs([c for c in children if c.is_running()], timeout=5)
    alive = [c for c in alive if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(c.pid, c.cmdline()) for c in alive]


def test_a_batch_with_a_bad_prompt_queues_nothing(server):
    """Every prompt of a batch is checked before any is queued: a bad last prompt is a 400
    naming it, and none of the good ones before it ran (no prompt tokens counted)."""
    before = wait_idle(server.url)
    body = {"model": SERVED_NAME, "prompt": [[5, 6, 7]] * 20 + [[5, VOCAB_SIZE]], "max_tokens": 8}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[20]", r.text
    after = wait_idle(server.url)
    assert after["halserve:prompt_tokens_total"] == before["halserve:prompt_tokens_total"]

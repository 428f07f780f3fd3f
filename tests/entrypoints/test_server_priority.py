"""``halserve serve --scheduling-policy priority``: a request's ``priority`` crosses to the engine-core
process (the default, its own process) and an urgent request overtakes queued and running low-priority
ones, with the same greedy outputs as the FCFS server; under fcfs a priority is a 400 naming the flag."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from server_utils import SERVED_NAME, ServerProcess, server_args

pytestmark = pytest.mark.slow  # starts a server (inner loop: -m 'not slow')

PROMPTS = {"L0": "the quick brown fox", "L1": "a b c d e", "L2": "one two three", "U": "hello there"}


def body(prompt: str, priority: int = 0, max_tokens: int = 100, **extra) -> dict:
    return {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "priority": priority, **extra}


@pytest.fixture(scope="module")
def priority_server(checkpoint, tmp_path_factory):
    args = server_args(checkpoint, "--scheduling-policy", "priority", "--max-num-seqs", "1")
    srv = ServerProcess(args, str(tmp_path_factory.mktemp("logs") / "priority.log")).wait_ready()
    yield srv
    srv.stop()


def test_urgent_request_overtakes_low_priority_ones(priority_server, server):
    async def main():
        done: dict[str, float] = {}
        texts: dict[str, str] = {}
        async with httpx.AsyncClient(base_url=priority_server.url, timeout=120) as http:
            async def complete(name: str, priority: int, max_tokens: int = 100) -> None:
                out = await http.post("/v1/completions", json=body(PROMPTS[name], priority, max_tokens))
                assert out.status_code == 200, out.text
                texts[name] = out.json()["choices"][0]["text"]
                done[name] = time.monotonic()

            async def stream_l0() -> None:  # (running once its first chunk is back)
                chunks = []
                async with http.stream("POST", "/v1/completions",
                                       json=body(PROMPTS["L0"], 5, stream=True)) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            chunks.append(json.loads(line[6:])["choices"][0]["text"])
                            if len(chunks) == 1:
                                started.set()
                texts["L0"] = "".join(chunks)
                done["L0"] = time.monotonic()

            started = asyncio.Event()
            l0 = asyncio.ensure_future(stream_l0())
            await started.wait()
            lows = [asyncio.ensure_future(complete(name, 5)) for name in ("L1", "L2")]
            await asyncio.sleep(0.05)
            await complete("U", -3, max_tokens=8)
            await asyncio.gather(l0, *lows)
        return done, texts

    done, texts = asyncio.run(main())
    assert done["U"] < done["L1"] and done["U"] < done["L2"], done
    # the same greedy text as the FCFS server gives each prompt
    for name, text in texts.items():
        want = httpx.post(server.url + "/v1/completions", timeout=120,
                          json=body(PROMPTS[name], 0, 8 if name == "U" else 100)).json()["choices"][0]["text"]
        assert text == want, name


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fcfs_server_refuses_a_priority(server, path):
    payload = (body("hi", priority=3, max_tokens=4) if path == "/v1/completions" else
               {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "priority": 3})
    out = httpx.post(server.url + path, json=payload, timeout=60)
    assert out.status_code == 400, out.text
    error = out.json()["error"]
    assert "--scheduling-policy priority" in error["message"] and error["param"] == "priority", error
    payload["priority"] = 0  # (0 is every request's priority under fcfs)
    assert httpx.post(server.url + path, json=payload, timeout=60).status_code == 200

"""The bundled demo model, served by `halserve serve` with no MODEL, answers held-out
addition problems through the OpenAI API."""
from __future__ import annotations

import asyncio
import random

import pytest
from server_utils import ServerProcess

from halserve.demo import DEMO_MODEL_NAME, is_correct, make_problem

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    # No MODEL argument: the demo model is served.
    srv = ServerProcess(["--platform", "cpu", "--log-level", "warning"],
                        str(tmp_path_factory.mktemp("logs") / "demo.log")).wait_ready()
    yield srv
    srv.stop()


def test_demo_model_is_listed(demo_server):
    import openai

    client = openai.OpenAI(base_url=demo_server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [DEMO_MODEL_NAME]
    out = client.completions.create(model=DEMO_MODEL_NAME, prompt="123+456=", max_tokens=8, temperature=0)
    assert out.choices[0].text == "579" and out.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model=DEMO_MODEL_NAME, messages=[{"role": "user", "content": "123+456"}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == "579"


def test_demo_model_solves_held_out_problems(demo_server):
    import openai

    rng = random.Random(2024)
    problems = [make_problem(rng) for _ in range(200)]  # held-out pairs only

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=demo_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        sem = asyncio.Semaphore(32)

        async def one(prompt: str) -> str:
            async with sem:
                out = await client.completions.create(model=DEMO_MODEL_NAME, prompt=prompt, max_tokens=8,
                                                      temperature=0)
                return out.choices[0].text

        return await asyncio.gather(*(one(p) for p, _ in problems))

    answers = asyncio.run(run())
    correct = sum(is_correct(p, a) for (p, _), a in zip(problems, answers))
    print(f"demo model through the server: {correct}/{len(problems)} held-out problems correct")
    assert correct >= 0.95 * len(problems)

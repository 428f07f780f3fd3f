"""use_beam_search over HTTP (the official openai client): the choices are the offline
LLM.beam_search's beams, in its order; what beam search cannot honour is a 400 naming the
field; a client that goes away aborts the search."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from server_utils import MAX_MODEL_LEN, SERVED_NAME
from test_server_load import scrape, wait_idle

from halserve import LLM
from halserve.beam_search import BeamSearchParams
from halserve.detokenizer import IncrementalDetokenizer
from halserve.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')

PROMPTS = ["the quick brown fox", "tell me about paris"]
MESSAGES = [{"role": "user", "content": "tell me a story"}]


@pytest.fixture(scope="module")
def offline(checkpoint):
    return LLM(checkpoint, platform="cpu", dtype="float32", block_size=16, max_model_len=MAX_MODEL_LEN)


def generated_text(llm: LLM, prompt_ids: list[int], tokens: list[int]) -> str:
    """The beam's generated tokens decoded as the engine decodes a completion."""
    detokenizer = IncrementalDetokenizer(llm.get_tokenizer(), prompt_ids, SamplingParams())
    detokenizer.update(tokens[len(prompt_ids):])
    return detokenizer.output_text


def test_completion_choices_are_the_offline_beams(client, offline):
    params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.7)
    want = offline.beam_search(PROMPTS, params)
    got = client.completions.create(model=SERVED_NAME, prompt=PROMPTS, n=3, max_tokens=6,
                                    extra_body={"use_beam_search": True, "length_penalty": 0.7})
    assert [c.index for c in got.choices] == list(range(6))
    for i, out in enumerate(want):
        for j, seq in enumerate(out.sequences):
            choice = got.choices[i * 3 + j]
            assert choice.text == generated_text(offline, out.prompt_token_ids, seq.tokens)
            assert choice.finish_reason == seq.finish_reason
    assert got.usage.prompt_tokens == sum(len(out.prompt_token_ids) for out in want)
    assert got.usage.completion_tokens == sum(len(s.tokens) - len(out.prompt_token_ids)
                                              for out in want for s in out.sequences)
    echoed = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], n=3, max_tokens=6, echo=True,
                                       extra_body={"use_beam_search": True, "length_penalty": 0.7})
    assert [c.text for c in echoed.choices] == [PROMPTS[0] + c.text for c in got.choices[:3]]


def test_beam_width_one_over_http_is_greedy(client):
    kwargs = dict(model=SERVED_NAME, prompt=PROMPTS[1], max_tokens=10)
    greedy = client.completions.create(**kwargs, temperature=0, extra_body={"ignore_eos": True})
    beam = client.completions.create(**kwargs, extra_body={"use_beam_search": True, "ignore_eos": True})
    assert beam.choices[0].text == greedy.choices[0].text and beam.choices[0].finish_reason == "length"


def test_chat_choices_are_the_offline_beams_streamed_or_not(client, offline):
    tokenizer = offline.get_tokenizer()
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
    (want,) = offline.beam_search({"prompt_token_ids": prompt_ids}, BeamSearchParams(beam_width=4, max_tokens=5))
    kwargs = dict(model=SERVED_NAME, messages=MESSAGES, n=4, max_completion_tokens=5, temperature=0,
                  extra_body={"use_beam_search": True})
    got = client.chat.completions.create(**kwargs)
    assert [c.message.content for c in got.choices] == [generated_text(offline, prompt_ids, s.tokens)
                                                        for s in want.sequences]
    assert [c.finish_reason for c in got.choices] == [s.finish_reason for s in want.sequences]
    assert got.usage.prompt_tokens == len(prompt_ids)

    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    content, finish, roles = {}, {}, {}
    for chunk in chunks:
        for c in chunk.choices:
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
            roles.setdefault(c.index, c.delta.role)
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [content[i] for i in range(4)] == [c.message.content for c in got.choices]
    assert [finish[i] for i in range(4)] == [c.finish_reason for c in got.choices]
    assert set(roles.values()) == {"assistant"} and chunks[-1].usage.total_tokens == got.usage.total_tokens


BEAM = {"use_beam_search": True, "n": 2}
BAD = {  # endpoint, extra fields -> the param the 400 names
    "temperature > 0": ("completions", {"temperature": 0.7}, "temperature"),
    "logprobs": ("completions", {"logprobs": 0}, "logprobs"),
    "stream": ("completions", {"stream": True}, "stream"),
    "top_p": ("completions", {"top_p": 0.5}, "top_p"),
    "stop": ("completions", {"stop": ["."]}, "stop"),
    "beam width over 10": ("completions", {"n": 11}, "n"),
    "max_tokens 0": ("completions", {"max_tokens": 0, "echo": True}, "max_tokens"),
    "prompt too long": ("completions", {"prompt": [5] * (MAX_MODEL_LEN + 1)}, "prompt"),
    "chat logprobs": ("chat", {"logprobs": True}, "logprobs"),
    "chat structured output": ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    "chat guided_choice": ("chat", {"guided_choice": ["a", "b"]}, "guided_choice"),
    "chat tools": ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    "chat temperature": ("chat", {"temperature": 1.0}, "temperature"),
    "chat prompt too long": ("chat", {"messages": [{"role": "user", "content": "hello world " * 100}]},
                             "messages"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_what_beam_search_cannot_honour_is_a_400_naming_it(client, case):
    endpoint, extra, param = BAD[case]
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "completions":
            client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], max_tokens=3,
                                      extra_body={**BEAM, **extra})
        else:
            client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_completion_tokens=3,
                                           extra_body={**BEAM, **extra})
    assert info.value.body["param"] == param, info.value.body
    assert param.split("[")[0] in info.value.body["message"] or param in ("prompt", "messages")


def test_length_penalty_needs_beam_search(client):
    with pytest.raises(openai.BadRequestError, match="length_penalty only applies to beam search"):
        client.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=2, extra_body={"length_penalty": 2.0})


def test_client_disconnect_aborts_the_search(server):
    # 8 prompts x 8 beams x 120 steps: the search runs for seconds; the client leaves once it runs
    num, n, max_tokens = 8, 8, 120
    body = {"model": SERVED_NAME, "prompt": [PROMPTS[0]] * num, "max_tokens": max_tokens, "n": n,
            "use_beam_search": True, "ignore_eos": True}
    before = wait_idle(server.url)

    async def leave_mid_search():
        async with httpx.AsyncClient(timeout=60) as aclient:
            request = asyncio.ensure_future(aclient.post(server.url + "/v1/completions", json=body))
            deadline = time.monotonic() + 20
            while scrape(server.url)["halserve:generation_tokens_total"] == before["halserve:generation_tokens_total"]:
                assert time.monotonic() < deadline and not request.done(), "the search did not start"
                await asyncio.sleep(0.05)
            request.cancel()  # (the connection closes)
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(leave_mid_search())
    # the search stops: no step runs after the one in flight (aborted), the KV cache is freed
    after = wait_idle(server.url)
    time.sleep(1.0)
    assert scrape(server.url)["halserve:generation_tokens_total"] == after["halserve:generation_tokens_total"]
    assert after["halserve:generation_tokens_total"] - before["halserve:generation_tokens_total"] < \
        num * n * max_tokens // 4
    assert after["halserve:kv_cache_usage_perc"] == pytest.approx(before["halserve:kv_cache_usage_perc"], abs=1e-9)

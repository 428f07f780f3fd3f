"""/v1/completions logprobs ``text_offset``: each token's start in the choice's returned text
(the text a stream's client accumulates), whatever echo, streaming, n or special tokens."""
from __future__ import annotations

import pytest
from server_utils import SERVED_NAME

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')


@pytest.fixture(scope="module")
def added_tokens(checkpoint) -> set[str]:
    """Special and added tokens (BOS, pad, chat markers): their text may be left out."""
    from transformers import AutoTokenizer

    return set(AutoTokenizer.from_pretrained(checkpoint).get_added_vocab())


def assert_offsets_index_text(text: str, tokens: list[str], offsets: list[int], added: set[str]) -> None:
    assert len(offsets) == len(tokens)
    assert offsets == sorted(offsets), (text, tokens, offsets)
    assert all(0 <= o <= len(text) for o in offsets), (text, tokens, offsets)
    for token, offset in zip(tokens, offsets):
        if token in added or "\ufffd" in token:  # may be skipped / part of a character split over tokens
            continue
        if offset == len(text):  # past a matched stop string, which cut the text
            continue
        assert text[offset : offset + len(token)] == token, (text, tokens, offsets)


def complete(client, stream: bool, **kwargs) -> dict[int, tuple[str, list[str], list[int]]]:
    """Choice index -> (text, tokens, text_offset), a stream's chunks joined."""
    kwargs = dict(model=SERVED_NAME, **kwargs)
    if not stream:
        out = client.completions.create(**kwargs)
        return {c.index: (c.text, c.logprobs.tokens, c.logprobs.text_offset) for c in out.choices}
    choices: dict[int, tuple[str, list[str], list[int]]] = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            text, tokens, offsets = choices.get(c.index, ("", [], []))
            if c.logprobs is not None:
                tokens, offsets = tokens + c.logprobs.tokens, offsets + c.logprobs.text_offset
            choices[c.index] = (text + c.text, tokens, offsets)
    return choices


def test_echo_offsets_skip_bos_and_skipped_special_tokens(client, added_tokens):
    for stream in (False, True):
        (text, tokens, offsets), = complete(client, stream, prompt="hello world", max_tokens=3, echo=True,
                                            logprobs=0, temperature=0).values()
        assert text.startswith("hello world")
        # '<s>' is not in the echoed text: it and 'he' both start at 0
        assert tokens[:4] == ["<s>", "he", "llo", " world"] and offsets[:4] == [0, 0, 2, 5]
        assert_offsets_index_text(text, tokens, offsets, added_tokens)


CASES = {
    "plain": dict(prompt="the quick brown fox", max_tokens=16),
    "echo": dict(prompt="hello world", max_tokens=16, echo=True),
    "echo-token-ids": dict(prompt=[1, 2, 3, 40], max_tokens=16, echo=True),  # echo decodes them, specials kept
    "keep-special": dict(prompt="hello world", max_tokens=16, echo=True, extra_body={"skip_special_tokens": False}),
    "stop-string": dict(prompt="hello world", max_tokens=16, stop=["aid", "an"]),
    "n2": dict(prompt="hello world", max_tokens=16, echo=True, n=2, temperature=1.0, seed=7),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", list(CASES))
def test_offsets_index_the_returned_text(client, added_tokens, case, stream):
    kwargs = {"temperature": 0, "logprobs": 1, **CASES[case]}
    extra = {"ignore_eos": True, **kwargs.pop("extra_body", {})}
    choices = complete(client, stream, extra_body=extra, **kwargs)
    assert len(choices) == kwargs.get("n", 1)
    for text, tokens, offsets in choices.values():
        assert tokens
        assert_offsets_index_text(text, tokens, offsets, added_tokens)
    if kwargs["temperature"] == 0 or "seed" in kwargs:  # reproducible: a stream gives the same offsets
        assert complete(client, not stream, extra_body=extra, **kwargs) == choices


def test_offsets_with_tokens_as_ids(client):
    kwargs = dict(prompt="hello world", max_tokens=12, echo=True, logprobs=0, temperature=0)
    (text, _, offsets), = complete(client, False, extra_body={"ignore_eos": True}, **kwargs).values()
    for stream in (False, True):
        extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
        (as_ids_text, tokens, as_ids), = complete(client, stream, extra_body=extra, **kwargs).values()
        assert all(t.startswith("token_id:") for t in tokens)
        assert (as_ids_text, as_ids) == (text, offsets)

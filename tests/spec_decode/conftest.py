"""Fixtures for the speculative decoding tests: one tiny random-weight llama checkpoint (and a
copy that knows only 24 tokens, whose sampled outputs repeat enough for drafts to be accepted),
and engines built once per session, keyed by their arguments."""
from __future__ import annotations

import pytest

# engine arguments shared by every engine of these tests
BASE_KWARGS = dict(platform="cpu", dtype="float32", max_model_len=128, max_num_batched_tokens=64, max_num_seqs=16)


@pytest.fixture(scope="session")
def spec_ckpt(tmp_path_factory):
    from model_factory import make_checkpoint

    return make_checkpoint(str(tmp_path_factory.mktemp("spec_llama")), "llama")


@pytest.fixture(scope="session")
def small_vocab_ckpt(spec_ckpt, tmp_path_factory):
    from model_factory import with_vocab_size

    return with_vocab_size(spec_ckpt, tmp_path_factory.mktemp("spec_llama_v24"), 24)


@pytest.fixture(scope="session")
def sliding_window_ckpt(tmp_path_factory):
    """Mistral with a 16-token sliding window: drafts checked past the window's edge."""
    from model_factory import make_checkpoint

    return make_checkpoint(str(tmp_path_factory.mktemp("spec_mistral")), "mistral", sliding_window=16)


@pytest.fixture(scope="session")
def engine_factory():
    """``get(path, k=None, **engine_kwargs)``: an ``LLM`` (with n-gram speculation of ``k`` tokens
    when k is given), built once per distinct set of arguments."""
    from halserve import LLM

    cache: dict = {}

    def get(path: str, k: int | None = None, **kwargs) -> LLM:
        kw = {**BASE_KWARGS, **kwargs}
        kw.setdefault("num_kv_blocks", 1024 // kw.get("block_size", 16) + 1)
        if k is not None:
            kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                                        "prompt_lookup_min": 1}
        key = (path, repr(sorted(kw.items(), key=lambda item: item[0])))
        if key not in cache:
            cache[key] = LLM(path, **kw)
        return cache[key]

    return get

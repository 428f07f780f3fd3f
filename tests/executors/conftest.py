"""Shared by the executor tests: a checkpoint two tensor-parallel ranks split evenly."""
from __future__ import annotations

import random

import pytest

PROMPT_LENGTHS = [1, 7, 16, 37, 70]  # under, at and over a block; 70 > the step budget of 64: chunked


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(path, prompts): num_heads 4, num_kv_heads 2, so two ranks hold two q heads and one kv head each."""
    from model_factory import make_checkpoint

    path = make_checkpoint(str(tmp_path_factory.mktemp("llama_tp")), "llama", num_layers=2, num_heads=4,
                           num_kv_heads=2, attention_bias=True, mlp_bias=True)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENGTHS]
    return path, prompts

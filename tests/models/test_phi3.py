"""halserve's Phi3ForCausalLM against transformers on tiny random Phi-3 checkpoints (fp32):
fused qkv/gate_up tensors, LongRoPE on both sides of original_max_position_embeddings,
partial rotary, GQA, sliding window, tensor parallelism and the offline ``LLM`` API."""
from __future__ import annotations

import functools
import json
import os

import pytest
import torch
from model_factory import _randomize, make_tokenizer
from test_llama_family import check_against_hf, prompts_for
from test_tensor_parallel import assert_two_ranks_match_one

from halserve.config import EngineConfig
from halserve.models.loader import get_model_info
from halserve.platforms.cpu import CpuPlatform

HIDDEN, HEAD_SIZE = 64, 16  # 4 heads of 16 unless a test says otherwise
ORIGINAL_MAX = 16  # original_max_position_embeddings of the LongRoPE checkpoints
SHORT_TEXTS = ["Tell me a story", "one two", "The red fox", "Hello world"]  # 4 to 8 tokens
LONG_TEXTS = [  # 18 to 37 tokens: past ORIGINAL_MAX from the prefill on
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a small red fox who would jump over the lazy brown dog every day.",
    "What is the capital city of France? Paris is the capital.",
    "Tell me about the capital city of France, and then write one question and one answer about Paris.",
]


def longrope(rotary_dim: int, **extra) -> dict:
    """LongRoPE parameters with distinct short and long factors, so using the wrong set shows."""
    half = rotary_dim // 2
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.25 * i for i in range(half)],
            "long_factor": [1.5 + 2.0 * i for i in range(half)], **extra}


@functools.cache
def tokenizer(vocab_size: int, seed: int):
    return make_tokenizer(vocab_size, seed)  # training one takes a second or two: once per vocab


def make_phi3(tmp_dir, *, num_heads: int = 4, num_kv_heads: int = 2, rope: dict | None = None,
              partial_rotary_factor: float | None = None, max_position_embeddings: int = 64,
              sliding_window: int | None = None, tie_word_embeddings: bool = False, vocab_size: int = 512,
              seed: int = 0) -> str:
    """A tiny random Phi3ForCausalLM checkpoint (fused qkv_proj / gate_up_proj) with a tokenizer."""
    from transformers import GenerationConfig, Phi3Config, Phi3ForCausalLM

    path = os.fspath(tmp_dir)
    extra = {} if partial_rotary_factor is None else {"partial_rotary_factor": partial_rotary_factor}
    config = Phi3Config(
        vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, original_max_position_embeddings=ORIGINAL_MAX,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, sliding_window=sliding_window,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_theta": 10000.0, **(rope or {"rope_type": "default"})}, **extra,
    )
    config.architectures = ["Phi3ForCausalLM"]
    torch.manual_seed(seed)
    model = Phi3ForCausalLM(config).to(torch.float32)
    _randomize(model, HIDDEN, seed)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer(vocab_size, seed).save_pretrained(path)
    return path


def test_plain_rope_gqa_sliding_window(tmp_path):
    # 4 query heads over 1 KV head; every layer slides a window of 6, shorter than the prompts
    path = make_phi3(tmp_path, num_kv_heads=1, sliding_window=6)
    model = check_against_hf(path, texts=SHORT_TEXTS + LONG_TEXTS[:2])
    assert [layer.sliding_window for layer in model.attention_layers] == [6, 6]
    assert model.attention_layers[0].num_kv_heads == 1


def test_longrope_below_original_max_uses_short_factors(tmp_path):
    # served with max_model_len = original max: no sequence can pass it, HF never switches to long
    path = make_phi3(tmp_path, rope=longrope(HEAD_SIZE))
    check_against_hf(path, texts=SHORT_TEXTS, max_model_len=ORIGINAL_MAX)


@pytest.mark.parametrize("extra", [{}, {"attention_factor": 0.8}], ids=["implied_attention_factor", "given"])
def test_longrope_above_original_max_uses_long_factors(tmp_path, extra):
    # max_model_len 64 > 16: long factors, as HF uses for prompts longer than the original max
    path = make_phi3(tmp_path, rope=longrope(HEAD_SIZE, **extra))
    check_against_hf(path, texts=LONG_TEXTS)


def test_partial_rotary_with_longrope_and_tied_embeddings(tmp_path):
    # Phi-4-mini's shape of config: 0.75 of each head rotated (12 of 16 dims), tied embeddings
    path = make_phi3(tmp_path, rope=longrope(12), partial_rotary_factor=0.75, tie_word_embeddings=True)
    model = check_against_hf(path, texts=LONG_TEXTS[:2])
    assert model.model.layers[0].self_attn.rotary_emb.rotary_dim == 12


def test_partial_rotary_plain_rope(tmp_path):
    path = make_phi3(tmp_path, partial_rotary_factor=0.5)
    model = check_against_hf(path, texts=SHORT_TEXTS + LONG_TEXTS[:1])
    assert model.model.layers[0].self_attn.rotary_emb.rotary_dim == 8


@pytest.mark.slow  # two spawned processes
def test_two_ranks_match_one_with_fused_checkpoint_tensors(tmp_path):
    """Each rank cuts its own q, k and v heads (gate and up rows) out of the fused tensors; a
    contiguous slice of the fused rows would hand rank 0 all of q and rank 1 the k/v heads."""
    path = make_phi3(tmp_path / "ckpt", num_heads=4, num_kv_heads=2, vocab_size=301,
                     rope=longrope(8), partial_rotary_factor=0.5)
    assert_two_ranks_match_one(path, tmp_path, 301)


def test_llm_generate_matches_transformers(tmp_path):
    from engine_helpers import hf_greedy

    from halserve import LLM, SamplingParams

    path = make_phi3(tmp_path, rope=longrope(12), partial_rotary_factor=0.75)
    prompts = prompts_for(path, LONG_TEXTS)
    llm = LLM(path, platform="cpu", dtype="float32", block_size=16, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(path, prompts, 8)


def test_longrope_factor_list_of_wrong_length_is_refused(tmp_path):
    path = make_phi3(tmp_path, rope=longrope(HEAD_SIZE))
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["rope_parameters"]["long_factor"] = config["rope_parameters"]["long_factor"][:-1]
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    with pytest.raises(Exception, match="long_factor.* length 8, got 7"):  # transformers' Phi3Config refuses it
        get_model_info(EngineConfig(model=path), CpuPlatform())

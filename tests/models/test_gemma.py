"""Gemma, Gemma 2 and Gemma 3 (text) against transformers on tiny random checkpoints (fp32):
all-token logits of one flattened multi-prompt prefill and greedy decodes through the paged
cache, with GQA, head_dim != hidden / heads, sliding windows shorter than the prompts and
(Gemma 2) attention and final logits soft-capping; two tensor-parallel ranks; how the
attention backend is chosen for a soft-capped model; one LLM-level greedy generation."""
from __future__ import annotations

import json
import logging
import math
import os
from types import SimpleNamespace

import pytest
import torch
from engine_helpers import hf_greedy
from model_factory import make_tokenizer
from test_llama_family import check_against_hf
from test_tensor_parallel import assert_two_ranks_match_one

from halserve.attention_backends.torch_ref import TorchAttentionBackend
from halserve.config import EngineConfig
from halserve.models.loader import get_model_info
from halserve.platforms.cpu import CpuPlatform
from halserve.plugins import Registry
from halserve.worker.backend_selection import select_attention_backend

VOCAB, HIDDEN = 512, 64
CONFIGS = {
    1: ("GemmaConfig", "GemmaForCausalLM"),
    2: ("Gemma2Config", "Gemma2ForCausalLM"),
    3: ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}


def make_gemma_checkpoint(tmp_dir, version: int, *, seed: int = 0, **overrides) -> str:
    """A tiny random Gemma<version> checkpoint with a tokenizer: 4 heads over 2 KV heads of
    size 32 (!= 64 / 4), weights at std 1/sqrt(hidden), norm weights w ~ 0.1 noise (Gemma
    scales by 1 + w); ``overrides`` go to the HF config."""
    import transformers
    from transformers import GenerationConfig

    path = os.fspath(tmp_dir)
    kwargs = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, intermediate_size=128, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    kwargs.update(overrides)
    config = getattr(transformers, CONFIGS[version][0])(**kwargs)
    config.architectures = [CONFIGS[version][1]]
    config.dtype = "float32"
    torch.manual_seed(seed)
    model = getattr(transformers, CONFIGS[version][1])(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(0.1 * noise if "norm" in name else noise / math.sqrt(HIDDEN))
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(VOCAB, seed).save_pretrained(path)
    return path


def gemma2_checkpoint(tmp_dir, **overrides) -> str:
    """3 layers: sliding (window 6), full, sliding; both soft-caps low enough to bite."""
    kwargs = dict(num_hidden_layers=3, sliding_window=6, query_pre_attn_scalar=24,
                  attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    return make_gemma_checkpoint(tmp_dir, 2, **(kwargs | overrides))


def test_gemma(tmp_path):
    model = check_against_hf(make_gemma_checkpoint(tmp_path, 1))
    assert model.attention_layers[0].head_size == 32
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_gemma2_soft_caps_and_alternating_window(tmp_path):
    model = check_against_hf(gemma2_checkpoint(tmp_path))
    assert [layer.sliding_window for layer in model.attention_layers] == [6, None, 6]
    assert {layer.backend.logits_soft_cap for layer in model.attention_layers} == {2.0}
    assert model.attention_layers[0].backend.scale == 24**-0.5


def test_gemma3_local_and_global_rope_from_a_legacy_config(tmp_path):
    """gemma-3 config.json files spell rope as rope_theta + rope_scaling (global layers) and
    rope_local_base_freq (sliding layers), and the pattern as sliding_window_pattern: the
    checkpoint is rewritten that way. transformers' Gemma 3 ignores attn_logit_softcapping
    (it never reaches attention); halserve must too, so it is set here."""
    path = make_gemma_checkpoint(tmp_path, 3, num_hidden_layers=4, sliding_window=5, sliding_window_pattern=3,
                                 query_pre_attn_scalar=48, final_logit_softcapping=3.0, attn_logit_softcapping=1.0)
    config_file = os.path.join(path, "config.json")
    with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    del config["rope_parameters"], config["layer_types"]
    config.update(rope_theta=10000.0, rope_local_base_freq=100.0, sliding_window_pattern=3,
                  rope_scaling={"rope_type": "linear", "factor": 2.0})
    with open(config_file, "w", encoding="utf-8") as f:
        json.dump(config, f)

    model = check_against_hf(path)
    layers = model.model.layers
    assert [layer.sliding_window for layer in model.attention_layers] == [5, 5, None, 5]
    assert layers[0].self_attn.rotary_emb is layers[1].self_attn.rotary_emb
    local, full = layers[0].self_attn.rotary_emb.cos_sin_cache, layers[2].self_attn.rotary_emb.cos_sin_cache
    assert not torch.equal(local, full)
    assert model.attention_layers[0].backend.logits_soft_cap is None


@pytest.mark.slow  # two spawned processes
def test_gemma2_two_ranks_match_one(tmp_path):
    """Heads, KV heads (one per rank), gate/up and a vocab of 301 split over two ranks; the
    window (4) is shorter than the longest prompt plus its decode."""
    path = gemma2_checkpoint(tmp_path / "ckpt", vocab_size=301, sliding_window=4)
    assert_two_ranks_match_one(path, tmp_path, 301)


class NoSoftCapBackend(TorchAttentionBackend):
    """A CPU backend like the torch one, but without logits soft-capping."""

    name = "no_soft_cap"
    platforms = ("cpu",)
    supports_logits_soft_cap = False


class NoSoftCapFirstCpuPlatform(CpuPlatform):
    preferred_attention_backends = ("no_soft_cap", *CpuPlatform.preferred_attention_backends)


@pytest.fixture
def registry_with_no_soft_cap_backend(monkeypatch):
    """The registered attention backends plus NoSoftCapBackend, seen by backend selection."""
    import halserve.plugins
    from halserve.plugins import get_plugin_manager

    real = get_plugin_manager()
    registry = Registry("attention backend")
    for reg in real.attention_backends:
        registry.add(reg.name, reg.plugin, reg.obj)
    registry.add(NoSoftCapBackend.name, "test", NoSoftCapBackend)
    manager = SimpleNamespace(attention_backends=registry, models=real.models)
    monkeypatch.setattr(halserve.plugins, "get_plugin_manager", lambda: manager)
    return registry


def test_cpu_selects_a_soft_capping_backend_for_gemma2(tmp_path, registry_with_no_soft_cap_backend, caplog):
    capped = gemma2_checkpoint(tmp_path / "gemma2")
    uncapped = make_gemma_checkpoint(tmp_path / "gemma", 1)
    platform = NoSoftCapFirstCpuPlatform()

    config = EngineConfig(model=uncapped, dtype="float32")
    assert select_attention_backend(config, platform, get_model_info(config, platform)) is NoSoftCapBackend

    config = EngineConfig(model=capped, dtype="float32")
    info = get_model_info(config, platform)
    assert info.logits_soft_cap == 2.0
    with caplog.at_level(logging.INFO, logger="halserve.worker.backend_selection"):
        chosen = select_attention_backend(config, platform, info)
    assert chosen.name in CpuPlatform.preferred_attention_backends and chosen.supports_logits_soft_cap
    assert f"attention backend {chosen.name} selected" in caplog.text
    assert "no_soft_cap: logits soft-cap not supported" in caplog.text

    forced = EngineConfig(model=capped, dtype="float32", attention_backend="no_soft_cap")
    with pytest.raises(ValueError, match=r"'no_soft_cap' cannot run this model: logits soft-cap not supported; "
                                         r"on platform 'cpu' use one of: .*torch"):
        select_attention_backend(forced, platform, info)


def test_llm_greedy_generation_matches_transformers(tmp_path):
    from halserve import LLM, SamplingParams

    path = gemma2_checkpoint(tmp_path)
    prompts = [[1, 45, 74, 299, 17, 273, 5, 88, 410, 9, 33], [1, 300, 2, 9], [1, 100, 101, 102, 103, 104, 105, 106]]
    want = hf_greedy(path, prompts, max_new_tokens=12)
    llm = LLM(path, platform="cpu", dtype="float32", block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == want


@pytest.mark.parametrize("overrides,match", [
    (dict(hidden_activation="gelu"), r"hidden_activation 'gelu' is not supported for gemma2; only 'gelu_pytorch_tanh'"),
    (dict(use_bidirectional_attention=True), r"use_bidirectional_attention=True .* set it to false"),
])
def test_configs_it_cannot_serve_are_refused_by_name(overrides, match):
    from transformers import Gemma2Config

    from halserve.layers import ModelContext
    from halserve.models.gemma import GemmaForCausalLM

    config = Gemma2Config(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, intermediate_size=128, **overrides)
    with pytest.raises(ValueError, match=match):
        GemmaForCausalLM(config, ModelContext("cpu", torch.float32, TorchAttentionBackend))

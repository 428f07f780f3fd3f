"""Model info, path resolution and loader errors (config files only, no forward passes)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from model_factory import make_checkpoint

from halserve.attention_backends.torch_ref import TorchAttentionBackend
from halserve.config import EngineConfig
from halserve.models.loader import get_model_info, load_model, resolve_model_path
from halserve.platforms.cpu import CpuPlatform


@pytest.fixture(scope="module")
def qwen2_path(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2", sliding_window=6, max_window_layers=1,
                           num_layers=3)
    gen_path = os.path.join(path, "generation_config.json")
    with open(gen_path) as f:
        gen = json.load(f)
    gen.update(eos_token_id=[2, 5], temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
    with open(gen_path, "w") as f:
        json.dump(gen, f)
    return path


def test_model_info(qwen2_path):
    info = get_model_info(EngineConfig(model=qwen2_path), CpuPlatform())
    assert info.architecture == "Qwen2ForCausalLM"
    assert info.model_path == qwen2_path
    assert info.dtype == torch.float32
    assert (info.vocab_size, info.hidden_size, info.num_layers) == (512, 64, 3)
    assert (info.num_heads, info.num_kv_heads, info.head_size) == (4, 2, 16)
    assert info.max_model_len == 512
    assert info.sliding_window == 6
    assert info.eos_token_ids == [2, 5]
    assert info.generation_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert info.kv_cache_bytes_per_token == 2 * 3 * 2 * 16 * 4
    fp8 = get_model_info(EngineConfig(model=qwen2_path, kv_cache_dtype="fp8"), CpuPlatform())
    assert fp8.kv_cache_bytes_per_token == 2 * 3 * 2 * 16


def test_max_model_len(qwen2_path):
    assert get_model_info(EngineConfig(model=qwen2_path, max_model_len=100), CpuPlatform()).max_model_len == 100
    with pytest.raises(ValueError, match="max_model_len 1000 .* max_position_embeddings 512"):
        get_model_info(EngineConfig(model=qwen2_path, max_model_len=1000), CpuPlatform())


def test_dtype_auto_follows_checkpoint_then_platform(tmp_path, monkeypatch):
    # a CPU with native bf16 dot products keeps a bf16 checkpoint in bf16 (without them, auto
    # picks float32: tests/platforms/test_cpu_auto_dtype.py)
    from halserve.platforms.cpu_kernels import panel

    monkeypatch.setattr(panel, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    path = make_checkpoint(tmp_path, "llama", num_layers=1)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["dtype"] = "bfloat16"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)

    class Fp32Only(CpuPlatform):
        supported_dtypes = ("float32",)

    assert get_model_info(EngineConfig(model=path), CpuPlatform()).dtype == torch.bfloat16
    assert get_model_info(EngineConfig(model=path), Fp32Only()).dtype == torch.float32
    assert get_model_info(EngineConfig(model=path, dtype="half"), CpuPlatform()).dtype == torch.float16
    # a bf16 model loads: parameters in bf16, logits float32
    config = EngineConfig(model=path)
    info = get_model_info(config, CpuPlatform())
    model = load_model(config, info, CpuPlatform(), TorchAttentionBackend, progress=False)
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.dtype == torch.float32


def test_unsupported_architecture_lists_supported_ones(tmp_path):
    path = make_checkpoint(tmp_path, "llama", num_layers=1)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["FancyForCausalLM"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=r"FancyForCausalLM.*no native halserve implementation.*LlamaForCausalLM.*Qwen3ForCausalLM.*"
                       r"Transformers backend fallback refuses it.*no class 'FancyForCausalLM'"):
        get_model_info(EngineConfig(model=path), CpuPlatform())


def test_missing_weights_are_reported(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_checkpoint(tmp_path, "llama", num_layers=1)
    weights = load_file(os.path.join(path, "model.safetensors"))
    del weights["model.norm.weight"]
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = EngineConfig(model=path)
    info = get_model_info(config, CpuPlatform())
    with pytest.raises(ValueError, match="no weights for: model.norm.weight"):
        load_model(config, info, CpuPlatform(), TorchAttentionBackend, progress=False)


def test_unknown_model_mentions_offline_use(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="no-such-org/no-such-model.*offline"):
        resolve_model_path("no-such-org/no-such-model")


def test_local_dir_is_used_as_is(tmp_path):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_model_protocol(qwen2_path):
    config = EngineConfig(model=qwen2_path)
    info = get_model_info(config, CpuPlatform())
    model = load_model(config, info, CpuPlatform(), TorchAttentionBackend, progress=False)
    assert not model.training
    assert len(model.attention_layers) == 3
    assert [a.sliding_window for a in model.attention_layers] == [None, 6, 6]
    hidden = torch.randn(2, 64)
    assert model.compute_logits(hidden).shape == (2, 512)

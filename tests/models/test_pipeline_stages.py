"""Pipeline-parallel stages of every architecture, in one process: each stage is built and loaded
as its rank would (the pipeline state set by hand), and the stages chained (stage s's
intermediate tensors into stage s + 1) give the whole model's logits. The engine-level tests
with real ranks are in tests/executors/test_pipeline_parallel.py."""
from __future__ import annotations

import math
import os

import pytest
import torch
from model_factory import _randomize, make_checkpoint, make_tokenizer
from paged_harness import PagedHarness
from staged import load

PROMPTS = [[1, 45, 74, 299, 17, 273, 5, 9, 11], [1, 300, 2, 9], [1, 100]]
VOCAB = 512


def _logits(model) -> torch.Tensor:
    """Prefill PROMPTS in one step, then two decode steps; the logits of every scheduled token."""
    from halserve.attention_backends.torch_ref import TorchAttentionBackend

    harness = PagedHarness(model, TorchAttentionBackend, block_size=4)
    out = [harness.step([(f"r{i}", p) for i, p in enumerate(PROMPTS)])]
    for token in (7, 300):
        out.append(harness.step([(f"r{i}", [token]) for i in range(len(PROMPTS))]))
    return torch.cat(out)


def _save_tiny(tmp_dir, config_name: str, architecture: str, **overrides) -> str:
    """A tiny random checkpoint of any transformers architecture (vocab 512, hidden 64, 3 layers)."""
    import transformers
    from transformers import GenerationConfig

    kwargs = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=1 / math.sqrt(64))
    config = getattr(transformers, config_name)(**(kwargs | overrides))
    config.architectures = [architecture]
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).to(torch.float32)
    _randomize(model, 64, seed=0)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    path = os.fspath(tmp_dir)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(VOCAB).save_pretrained(path)
    return path


CASES = {
    # name: (checkpoint writer, stages)
    "llama-tied": (lambda d: make_checkpoint(d, "llama", num_layers=3, tie_word_embeddings=True,
                                             attention_bias=True, mlp_bias=True), 2),
    "qwen3-3-stages": (lambda d: make_checkpoint(d, "qwen3", num_layers=4), 3),
    "mistral-window": (lambda d: make_checkpoint(d, "mistral", num_layers=3, sliding_window=5), 2),
    "gemma2": (lambda d: _save_tiny(d, "Gemma2Config", "Gemma2ForCausalLM", head_dim=16, sliding_window=6,
                                    query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
                                    final_logit_softcapping=3.0, tie_word_embeddings=True), 2),
    "phi3": (lambda d: _save_tiny(d, "Phi3Config", "Phi3ForCausalLM"), 3),
    "mixtral": (lambda d: _save_tiny(d, "MixtralConfig", "MixtralForCausalLM", num_local_experts=4,
                                     num_experts_per_tok=2), 2),
    "qwen2-moe": (lambda d: _save_tiny(d, "Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=64, decoder_sparse_step=2), 2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_chained_stages_give_the_whole_models_logits(tmp_path, case):
    write, num_stages = CASES[case]
    path = write(tmp_path / "ckpt")
    whole = _logits(load(path))
    staged = load(path, num_stages)
    torch.testing.assert_close(_logits(staged), whole, rtol=1e-5, atol=1e-5)


def test_each_stage_holds_only_its_own_weights(tmp_path):
    """5 layers over 2 stages: 3 + 2 (the extra layer goes before the last stage, which runs the
    head). Stage 0 has the embedding and layers 0-2; stage 1 layers 3-4, the norm and the head."""
    path = make_checkpoint(tmp_path / "ckpt", "llama", num_layers=5)
    first, last = load(path, 2).stages
    names = [{n.split(".weight")[0] for n, _ in stage.named_parameters()} for stage in (first, last)]
    layers = [sorted({int(n.split(".")[2]) for n in stage if ".layers." in n}) for stage in names]
    assert layers == [[0, 1, 2], [3, 4]]
    assert "model.embed_tokens" in names[0] and "model.embed_tokens" not in names[1]
    assert not any(n.startswith(("model.norm", "lm_head")) for n in names[0])
    assert {"model.norm", "lm_head"} <= names[1]
    assert [len(stage.attention_layers) for stage in (first, last)] == [3, 2]


def test_layer_partition(monkeypatch):
    from halserve.models.pipeline import PARTITION_ENV, layer_partition

    assert layer_partition(12, 1) == [12]
    assert layer_partition(12, 4) == [3, 3, 3, 3]
    assert layer_partition(8, 3) == [3, 3, 2]
    assert layer_partition(3, 3) == [1, 1, 1]
    with pytest.raises(ValueError, match="pipeline_parallel_size 4 is more than the model's 3 layers"):
        layer_partition(3, 4)
    monkeypatch.setenv(PARTITION_ENV, "1,4")
    assert layer_partition(5, 2) == [1, 4]
    for bad in ("2,2", "1,2,2", "0,5", "a,b"):
        monkeypatch.setenv(PARTITION_ENV, bad)
        with pytest.raises(ValueError, match=PARTITION_ENV):
            layer_partition(5, 2)


def test_more_stages_than_layers_is_refused_before_any_rank_starts(tmp_path):
    from halserve.config import EngineConfig
    from halserve.models.loader import get_model_info
    from halserve.platforms.cpu import CpuPlatform

    path = make_checkpoint(tmp_path / "ckpt", "llama", num_layers=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 is more than the model's 2 layers; "
                                         "use at most 2 stages"):
        get_model_info(EngineConfig(model=path, pipeline_parallel_size=3), CpuPlatform())

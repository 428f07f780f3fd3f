"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers on tiny random
checkpoints (fp32), in both expert layouts transformers writes; the FusedMoE weight loader over
simulated ranks; two real tensor-parallel ranks; the offline LLM (quantized experts:
tests/quantization/test_quantized_moe.py)."""
from __future__ import annotations

import math
import random
import socket

import pytest
import torch
import torch.multiprocessing as mp
from model_factory import _randomize, make_tokenizer
from test_llama_family import check_against_hf
from test_tensor_parallel import PROMPTS, run_model

import halserve.layers.fused_moe as fused_moe_mod
from halserve.attention_backends.torch_ref import TorchAttentionBackend
from halserve.layers import FusedMoE, ModelContext
from halserve.layers.fused_moe import ExpertWeightLoader, select_experts
from halserve.models.llama import LlamaMLP
from halserve.models.mixtral import MixtralForCausalLM
from halserve.models.qwen_moe import QwenMoeForCausalLM, QwenMoeSparseBlock

CTX = ModelContext("cpu", torch.float32, TorchAttentionBackend)
VOCAB, HIDDEN = 512, 64
ARCHS = {  # name -> (transformers config class, architecture, halserve class, its own defaults)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", MixtralForCausalLM,
                dict(num_local_experts=8, intermediate_size=64)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", QwenMoeForCausalLM,
                  dict(num_experts=6, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       intermediate_size=96)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", QwenMoeForCausalLM,
                  dict(num_experts=4, moe_intermediate_size=32, intermediate_size=96, head_dim=32)),
}


def hf_config(arch: str, **overrides):
    import transformers

    config_name, architecture, _, defaults = ARCHS[arch]
    kwargs = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=1 / math.sqrt(HIDDEN))
    config = getattr(transformers, config_name)(**(kwargs | defaults | overrides))
    config.architectures = [architecture]
    return config


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer(VOCAB)  # trained once: the slow part of writing a checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    """``checkpoint(arch, fused_experts=False, **config)`` -> a directory written by transformers'
    ``save_pretrained`` (per-expert tensors, or with ``fused_experts`` its fused 3-D layout)."""
    import transformers
    from transformers import GenerationConfig

    def make(arch: str, fused_experts: bool = False, seed: int = 0, **overrides) -> str:
        path = str(tmp_path_factory.mktemp(arch))
        config = hf_config(arch, **overrides)
        torch.manual_seed(seed)
        model = getattr(transformers, ARCHS[arch][1])(config).to(torch.float32)
        _randomize(model, HIDDEN, seed)  # router rows too: tokens spread over the experts
        model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
        model.save_pretrained(path, safe_serialization=True, save_original_format=not fused_experts)
        tokenizer.save_pretrained(path)
        return path

    return make


def checkpoint_names(path: str) -> list[str]:
    from safetensors import safe_open

    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        return list(f.keys())


# -- against transformers ------------------------------------------------------------------
@pytest.mark.parametrize("fused_experts", [False, True], ids=["per_expert", "fused"])
def test_mixtral(checkpoint, fused_experts):
    path = checkpoint("mixtral", fused_experts=fused_experts)
    names = checkpoint_names(path)
    if fused_experts:
        assert "model.layers.0.mlp.experts.gate_up_proj" in names
    else:
        assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in names
    model = check_against_hf(path)
    experts = model.model.layers[1].mlp.experts
    assert (experts.num_experts, experts.top_k, experts.renormalize) == (8, 2, True)


@pytest.mark.parametrize("fused_experts,norm_topk_prob,sparse", [
    (False, False, dict(decoder_sparse_step=2)),  # layer 0 dense, layer 1 sparse
    (True, True, dict(mlp_only_layers=[1])),  # layer 0 sparse, layer 1 dense
], ids=["per_expert-step2", "fused-mlp_only"])
def test_qwen2_moe_shared_expert_dense_and_sparse_layers(checkpoint, fused_experts, norm_topk_prob, sparse):
    path = checkpoint("qwen2_moe", fused_experts=fused_experts, norm_topk_prob=norm_topk_prob, **sparse)
    model = check_against_hf(path)
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert sorted(kinds, key=str) == [LlamaMLP, QwenMoeSparseBlock]
    block = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, QwenMoeSparseBlock))
    assert block.shared_expert is not None and block.experts.renormalize is norm_topk_prob
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None  # qkv_bias
    assert model.model.layers[0].self_attn.o_proj.bias is None


@pytest.mark.parametrize("norm_topk_prob,sparse", [
    (True, dict(mlp_only_layers=[1])),
    (False, dict()),
], ids=["renormalized-mlp_only", "all_sparse"])
def test_qwen3_moe_qk_norm_without_shared_expert(checkpoint, norm_topk_prob, sparse):
    path = checkpoint("qwen3_moe", norm_topk_prob=norm_topk_prob, **sparse)
    model = check_against_hf(path)
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, QwenMoeSparseBlock)]
    assert len(blocks) == (1 if sparse else 2)
    assert all(b.shared_expert is None and b.experts.renormalize is norm_topk_prob for b in blocks)
    assert model.model.layers[0].self_attn.has_qk_norm and model.attention_layers[0].head_size == 32


# -- the layer's weight loader ---------------------------------------------------------------
def expert_tensors(num_experts: int, hidden: int, inter: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(num_experts, inter, hidden, generator=g) / math.sqrt(hidden)
    up = torch.randn(num_experts, inter, hidden, generator=g) / math.sqrt(hidden)
    down = torch.randn(num_experts, hidden, inter, generator=g) / math.sqrt(inter)
    return gate, up, down


def as_rank(monkeypatch, rank: int, size: int) -> None:
    monkeypatch.setattr(fused_moe_mod, "get_tp_rank", lambda: rank)
    monkeypatch.setattr(fused_moe_mod, "get_tp_size", lambda: size)


def test_ranks_partial_sums_add_up_to_the_full_experts(monkeypatch):
    """Each simulated rank loads its intermediate slice of per-expert tensors; the partial outputs
    sum to the unsharded MoE, and the fused layout loads the same slices."""
    num_experts, hidden, inter = 4, 16, 12
    gate, up, down = expert_tensors(num_experts, hidden, inter)
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(1))
    router_logits = torch.randn(5, num_experts, generator=torch.Generator().manual_seed(2))
    weights, ids = select_experts(router_logits, 2, renormalize=True)
    assert torch.allclose(weights.sum(-1), torch.ones(5))
    want = torch.zeros(5, hidden)
    for t in range(5):
        for w, e in zip(weights[t], ids[t]):
            want[t] += w * (down[e] @ (torch.nn.functional.silu(gate[e] @ x[t]) * (up[e] @ x[t])))
    total = torch.zeros(5, hidden)
    for rank in range(2):
        as_rank(monkeypatch, rank, 2)
        layer = FusedMoE(num_experts, 2, hidden, inter, True, CTX, "mlp.experts")
        for e in range(num_experts):
            layer.w13_weight.weight_loader(layer.w13_weight, gate[e], "gate", e)
            layer.w13_weight.weight_loader(layer.w13_weight, up[e], "up", e)
            layer.w2_weight.weight_loader(layer.w2_weight, down[e], "down", e)
        fused = FusedMoE(num_experts, 2, hidden, inter, True, CTX, "mlp.experts")
        fused.w13_weight.weight_loader(fused.w13_weight, torch.cat([gate, up], dim=1))
        fused.w2_weight.weight_loader(fused.w2_weight, down)
        assert torch.equal(fused.w13_weight, layer.w13_weight) and torch.equal(fused.w2_weight, layer.w2_weight)
        assert layer.w13_weight.shape == (num_experts, 2 * inter // 2, hidden)
        total += layer(x, router_logits)
    torch.testing.assert_close(total, want, atol=1e-5, rtol=1e-5)


def test_loader_reports_missing_experts_and_wrong_shapes():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = FusedMoE(4, 2, 16, 12, False, CTX, "mlp.experts")

    model = torch.nn.Module()
    model.mlp = Block()
    gate, up, down = expert_tensors(4, 16, 12)
    names = {"w1": "gate", "w3": "up", "w2": "down"}
    weights = [(f"mlp.experts.{e}.w1.weight", gate[e]) for e in range(4)]
    weights += [(f"mlp.experts.{e}.w3.weight", up[e]) for e in range(3)]  # expert 3's up is missing
    weights += [("mlp.experts.down_proj", down), ("mlp.other.weight", torch.zeros(1))]
    loader = ExpertWeightLoader(model, names)
    assert [name for name, _ in loader.load_or_pass(weights)] == ["mlp.other.weight"]
    assert loader.loaded() == {"mlp.experts.w2_weight"}  # w13 incomplete: the model loader reports it
    with pytest.raises(ValueError, match=r"mlp.experts: checkpoint gate tensor has shape \(10, 16\), expected 12 rows"):
        list(loader.load_or_pass([("mlp.experts.0.w1.weight", torch.zeros(10, 16))]))
    with pytest.raises(ValueError, match="checkpoint has expert 4, the config declares num_experts=4"):
        list(loader.load_or_pass([("mlp.experts.4.w2.weight", torch.zeros(16, 12))]))


# -- two tensor-parallel ranks -------------------------------------------------------------
def _rank_main(rank: int, world_size: int, port: int, paths: list[str], out_file: str) -> None:
    import os

    os.environ["HALSERVE_CPU_THREADS"] = "1"
    from halserve.distributed import destroy_distributed, init_distributed

    init_distributed("gloo", f"tcp://127.0.0.1:{port}", rank, world_size)
    try:
        logits = [run_model(path) for path in paths]
        if rank == 0:
            torch.save(logits, out_file)
    finally:
        destroy_distributed()


@pytest.mark.slow  # two spawned processes
def test_two_ranks_match_one(checkpoint, tmp_path):
    """Qwen2-MoE (experts + shared expert reduced once, a dense layer) and Mixtral (experts reduced
    alone): each intermediate size split over two gloo ranks gives one rank's logits."""
    paths = [checkpoint("qwen2_moe", decoder_sparse_step=2, seed=3),
             checkpoint("mixtral", num_hidden_layers=1, seed=4)]
    want = [run_model(path) for path in paths]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_file = str(tmp_path / "tp2.pt")
    mp.start_processes(_rank_main, args=(2, port, paths, out_file), nprocs=2, join=True, start_method="spawn")
    got = torch.load(out_file)
    for g, w in zip(got, want):
        assert g.shape == w.shape == (sum(map(len, PROMPTS)) + len(PROMPTS), VOCAB)
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


# -- the offline API -------------------------------------------------------------------------
def test_llm_greedy_generation_matches_transformers(checkpoint):
    from engine_helpers import hf_greedy

    from halserve import LLM, SamplingParams

    path = checkpoint("mixtral", seed=5)
    rng = random.Random(7)
    prompts = [[1] + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (0, 6, 19, 40)]
    expected = hf_greedy(path, prompts, 8)
    llm = LLM(path, platform="cpu", dtype="float32", block_size=16, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected

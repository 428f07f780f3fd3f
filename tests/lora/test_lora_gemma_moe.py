"""LoRA on Gemma 2 and on mixture-of-experts models. PEFT's own adapters on attention and dense
MLP modules (Qwen2-MoE: its dense layer, its shared expert and the shared expert's gate) give
what their merged checkpoints give, in transformers and in halserve; an adapter that touches
MoE experts or routers is refused with an error naming the module, and the engine keeps serving."""
from __future__ import annotations

import json
import os
import random
import sys

import pytest
import torch

# the checkpoint builders of the model tests (tests/models is on sys.path only when they are collected)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models"))

from lora_factory import ENGINE_KWARGS, PROMPT_LENGTHS, greedy, prompt_dicts, sampled_logprobs, token_ids
from peft_reference import adapter_modules, halserve_greedy, hf_greedy_logprobs, make_peft_adapter
from test_gemma import gemma2_checkpoint
from test_moe import checkpoint, tokenizer  # noqa: F401  (fixtures: tiny MoE checkpoints written by transformers)

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
DENSE_MLP = ["gate_proj", "up_proj", "down_proj"]


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENGTHS]


def _serve_with_adapter(llm, lora, prompts: list[list[int]]):
    outs = llm.generate(prompt_dicts(prompts), greedy(logprobs=0), use_tqdm=False, lora_request=lora)
    return token_ids(outs), [sampled_logprobs(o) for o in outs]


def _assert_same(got, reference, atol: float) -> None:
    assert got[0] == reference[0]
    for lps, want in zip(got[1], reference[1]):
        assert lps == pytest.approx(want, abs=atol)


def _check_against_merged(base: str, adapter: str, merged: str, prompts: list[list[int]]):
    """The adapter's tokens and logprobs equal the merged checkpoint's in halserve and transformers;
    returns the LoRA engine (the caller shuts it down)."""
    from halserve import LLM, LoRARequest

    base_tokens = hf_greedy_logprobs(base, prompts)[0]
    references = [(halserve_greedy(merged, prompts), 1e-4), (hf_greedy_logprobs(merged, prompts), 1e-3)]
    llm = LLM(base, enable_lora=True, max_loras=1, **ENGINE_KWARGS)
    try:
        got = _serve_with_adapter(llm, LoRARequest("adapter", 1, adapter), prompts)
        assert got[0] != base_tokens  # the adapter matters
        for reference, atol in references:
            _assert_same(got, reference, atol)
    except BaseException:
        llm.llm_engine.shutdown()
        raise
    return llm


def test_gemma2_attention_and_mlp_adapter_equals_merged(tmp_path):
    # soft-capped attention and logits, sliding windows shorter than the prompts
    base = gemma2_checkpoint(tmp_path / "base")
    adapter, merged = make_peft_adapter(base, tmp_path / "adapter", tmp_path / "merged", ATTENTION + DENSE_MLP,
                                        seed=2)
    _check_against_merged(base, adapter, merged, _prompts(6)).llm_engine.shutdown()


def test_qwen2_moe_dense_and_shared_expert_adapter_equals_merged(checkpoint, tmp_path):  # noqa: F811
    from halserve import LoRARequest

    base = checkpoint("qwen2_moe", decoder_sparse_step=2)  # layer 0 dense, layer 1 sparse with a shared expert
    adapter, merged = make_peft_adapter(base, tmp_path / "adapter", tmp_path / "merged",
                                        ATTENTION + DENSE_MLP + ["shared_expert_gate"], seed=3)
    modules = adapter_modules(adapter)
    assert {"model.layers.0.mlp.gate_proj", "model.layers.1.mlp.shared_expert.down_proj",
            "model.layers.1.mlp.shared_expert_gate"} <= modules
    assert not any(".experts" in m or m.endswith("mlp.gate") for m in modules)  # PEFT adapts no expert
    prompts = _prompts(7)
    llm = _check_against_merged(base, adapter, merged, prompts)
    try:
        runner = llm.llm_engine.core.executor.worker.model_runner
        assert runner.lora_manager.targetable == set(ATTENTION + DENSE_MLP + ["shared_expert_gate"])
        hidden, inter, num_experts = _moe_sizes(runner.model.config)
        # an expert and the router, named as transformers' per-expert layout (and PEFT's all-linear on
        # it) names them: refused, and the engine serves on
        for i, (module, shape, why) in enumerate([
            ("model.layers.1.mlp.experts.0.gate_proj", (hidden, inter), "LoRA on MoE experts is not supported"),
            ("model.layers.1.mlp.gate", (hidden, num_experts), "LoRA on MoE routers is not supported"),
        ]):
            bad = LoRARequest(f"bad{i}", 10 + i, _write_adapter(tmp_path / f"bad{i}", {module: shape}, "all-linear"))
            with pytest.raises(ValueError, match=f"'bad{i}'.*module '{module}' is .*{why}"):
                _serve_with_adapter(llm, bad, prompts[:1])
            assert not llm.llm_engine.has_unfinished_requests()
        again = _serve_with_adapter(llm, LoRARequest("adapter", 1, adapter), prompts[:2])
        assert again[0] == hf_greedy_logprobs(merged, prompts[:2])[0]
    finally:
        llm.llm_engine.shutdown()


def _moe_sizes(config) -> tuple[int, int, int]:
    """(hidden size, one expert's intermediate size, number of experts) of a Mixtral / Qwen-MoE config."""
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return config.hidden_size, inter, getattr(config, "num_experts", None) or config.num_local_experts


def _write_adapter(path, modules: dict[str, tuple[int, int]], target_modules, r: int = 4, **config) -> str:
    """An adapter in PEFT's format with random weights for ``modules`` (name -> (in, out))."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for name, (num_in, num_out) in modules.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(r, num_in)
        tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(num_out, r)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": target_modules, **config}, f)
    return path


def test_mixtral_attention_adapter_works_and_expert_or_router_adapters_are_refused(checkpoint, tmp_path):  # noqa: F811
    from halserve import LoRARequest
    from halserve.layers import ReplicatedLinear

    base = checkpoint("mixtral")  # per-expert layout: block_sparse_moe.experts.{e}.w1/w2/w3, block_sparse_moe.gate
    adapter, merged = make_peft_adapter(base, tmp_path / "adapter", tmp_path / "merged", ATTENTION, seed=4)
    llm = _check_against_merged(base, adapter, merged, _prompts(8)[:3])
    try:
        runner = llm.llm_engine.core.executor.worker.model_runner
        assert type(runner.model.model.layers[0].mlp.gate) is ReplicatedLinear  # the router is not wrapped
        assert runner.lora_manager.targetable == set(ATTENTION)
        hidden, inter, num_experts = _moe_sizes(runner.model.config)
        q_proj = {"model.layers.0.self_attn.q_proj": (hidden, hidden)}
        expert, router = "LoRA on MoE experts is not supported", "LoRA on MoE routers is not supported"
        cases = [  # (adapter modules, target_modules, what the error says)
            ({"model.layers.0.block_sparse_moe.experts.3.w1": (hidden, inter)}, ".*w1",
             f"module 'model.layers.0.block_sparse_moe.experts.3.w1' is an expert of a mixture-of-experts layer; "
             f"{expert}"),
            ({"model.layers.1.block_sparse_moe.gate": (hidden, num_experts)}, ".*gate",
             f"module 'model.layers.1.block_sparse_moe.gate' is the router of a mixture-of-experts layer; {router}"),
            ({"model.layers.1.mlp.gate": (hidden, num_experts)}, ".*gate",
             f"module 'model.layers.1.mlp.gate' is the router of a mixture-of-experts layer; {router}"),
            (q_proj, ["q_proj", "w2"], f"target module 'w2' is an expert of a mixture-of-experts layer; {expert}"),
            (q_proj, ["gate", "q_proj"], f"target module 'gate' is the router of a mixture-of-experts layer; {router}"),
        ]
        for i, (modules, targets, why) in enumerate(cases):
            bad = LoRARequest(f"bad{i}", 10 + i, _write_adapter(tmp_path / f"bad{i}", modules, targets))
            with pytest.raises(ValueError, match=f"'bad{i}'") as info:
                llm.llm_engine.add_lora(bad)
            assert why in str(info.value)
            assert "(MixtralForCausalLM can adapt: k_proj, o_proj, q_proj, v_proj)" in str(info.value)
        # PEFT's LoRA on raw parameters (how it reaches fused expert tensors) is refused from its config
        bad = _write_adapter(tmp_path / "params", q_proj, ["q_proj"], target_parameters=["mlp.experts.gate_up_proj"])
        with pytest.raises(ValueError, match="target_parameters.*is not supported"):
            llm.llm_engine.add_lora(LoRARequest("params", 20, bad))
        assert runner.lora_manager.list_loras() == [1]  # only the good adapter was ever loaded
    finally:
        llm.llm_engine.shutdown()

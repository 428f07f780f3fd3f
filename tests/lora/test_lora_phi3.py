"""LoRA on Phi-3, whose HF checkpoints fuse q/k/v into ``self_attn.qkv_proj`` and gate/up into
``mlp.gate_up_proj``: PEFT's own adapter adapts those fused modules (lora_B [(Hq + 2Hk) D, r]
and [2I, r]), and halserve serves it like its merged checkpoint (transformers and halserve),
on one rank and on two (4 q heads over 1 kv head: each rank takes its q heads and a replica
of the kv head, and its rows of gate and of up)."""
from __future__ import annotations

import os
import random
import sys
from types import SimpleNamespace

import pytest

# the checkpoint builders of the model tests (tests/models is on sys.path only when they are collected)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models"))

from lora_factory import ENGINE_KWARGS, PROMPT_LENGTHS, greedy, prompt_dicts, sampled_logprobs, token_ids
from peft_reference import adapter_modules, halserve_greedy, hf_greedy_logprobs, make_peft_adapter
from test_phi3 import make_phi3

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')

TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    mk = tmp_path_factory.mktemp
    base = make_phi3(mk("phi3_base"), num_heads=4, num_kv_heads=1, max_position_embeddings=128)
    adapter, merged = make_peft_adapter(base, mk("phi3_adapter"), mk("phi3_merged"), TARGETS, seed=1)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENGTHS]
    return SimpleNamespace(base=base, adapter=adapter, prompts=prompts, merged=halserve_greedy(merged, prompts),
                           hf_merged=hf_greedy_logprobs(merged, prompts), base_out=halserve_greedy(base, prompts))


def test_peft_adapter_on_fused_modules_equals_merged(phi3):
    from halserve import LLM, LoRARequest

    assert adapter_modules(phi3.adapter) == {f"model.layers.{i}.{parent}.{module}" for i in range(2)
                                             for parent, module in [("self_attn", "qkv_proj"), ("self_attn", "o_proj"),
                                                                    ("mlp", "gate_up_proj"), ("mlp", "down_proj")]}
    llm = LLM(phi3.base, enable_lora=True, max_loras=1, **ENGINE_KWARGS)
    try:
        outs = llm.generate(prompt_dicts(phi3.prompts), greedy(logprobs=0), use_tqdm=False,
                            lora_request=LoRARequest("phi3-fused", 1, phi3.adapter))
    finally:
        llm.llm_engine.shutdown()
    tokens, logprobs = token_ids(outs), [sampled_logprobs(o) for o in outs]
    assert tokens != phi3.base_out[0]  # the adapter matters
    for reference, atol in ((phi3.merged, 1e-4), (phi3.hf_merged, 1e-3)):
        assert tokens == reference[0]
        for got, want in zip(logprobs, reference[1]):
            assert got == pytest.approx(want, abs=atol)


def test_adapter_names_checked_against_phi3_checkpoint_names(phi3, tmp_path):
    """Phi-3 checkpoints have no q_proj / gate_proj: an adapter naming them is refused, and the
    message lists the names Phi-3 does have."""
    from lora_factory import make_adapter
    from test_llama_family import load

    from halserve import LoRARequest
    from halserve.config import EngineConfig
    from halserve.lora.manager import LoRAManager

    model, _ = load(phi3.base)
    manager = LoRAManager(model, EngineConfig(model=phi3.base, enable_lora=True), model.lm_head.weight.device,
                          model.lm_head.weight.dtype)
    assert manager.targetable == set(TARGETS)
    llama_style = make_adapter(tmp_path / "llama_style", phi3.base, target_modules=("q_proj", "v_proj"))
    with pytest.raises(ValueError, match=r"'q_proj' is not a layer of Phi3ForCausalLM.*"
                                         r"it can: down_proj, gate_up_proj, o_proj, qkv_proj;"):
        manager.add(LoRARequest("llama-style", 1, llama_style))


def test_tp2_fused_adapter_mixed_batch_equals_merged(phi3):
    from halserve import LLM, LoRARequest

    lora = LoRARequest("phi3-fused", 1, phi3.adapter)
    choice = [lora, None, lora, lora, None]
    batch = [phi3.prompts[i % 4] for i in range(len(choice))]
    llm = LLM(phi3.base, tensor_parallel_size=2, enable_lora=True, max_loras=1, **ENGINE_KWARGS)
    try:
        outs = llm.generate(prompt_dicts(batch), greedy(logprobs=0), use_tqdm=False, lora_request=choice)
    finally:
        llm.llm_engine.shutdown()
    for i, (out, lora_used) in enumerate(zip(outs, choice)):
        reference = phi3.merged if lora_used else phi3.base_out
        assert out.outputs[0].token_ids == reference[0][i % 4]
        assert sampled_logprobs(out) == pytest.approx(reference[1][i % 4], abs=1e-4)

"""Fixtures for LoRA tests: one tiny base checkpoint, adapters in PEFT's format, the
checkpoints they merge into, and those checkpoints' greedy outputs (the independent
reference), made once per session."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from lora_factory import ENGINE_KWARGS, PROMPT_LENGTHS, greedy, prompt_dicts, sampled_logprobs, token_ids


@pytest.fixture(scope="session")
def lora_models(tmp_path_factory):
    """base: llama with q/k/v/o and mlp biases (num_heads 4, num_kv_heads 2); a1: every module,
    r=8; a2: q_proj and v_proj only, r=4 with rslora; merged1/merged2: base + each adapter."""
    from lora_factory import make_adapter, merge_adapter
    from model_factory import make_checkpoint

    mk = tmp_path_factory.mktemp
    base = make_checkpoint(str(mk("lora_base")), "llama", num_layers=2, attention_bias=True, mlp_bias=True)
    a1 = make_adapter(mk("a1"), base, r=8, lora_alpha=16, seed=1)
    a2 = make_adapter(mk("a2"), base, r=4, lora_alpha=8, seed=2, target_modules=("q_proj", "v_proj"),
                      use_rslora=True)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENGTHS]
    return SimpleNamespace(base=base, a1=a1, a2=a2, merged1=merge_adapter(base, a1, mk("merged1")),
                           merged2=merge_adapter(base, a2, mk("merged2")), prompts=prompts)


@pytest.fixture(scope="session")
def loras(lora_models):
    from halserve import LoRARequest

    return LoRARequest("a1", 1, lora_models.a1), LoRARequest("a2", 2, lora_models.a2)


@pytest.fixture(scope="session")
def merged_outputs(lora_models):
    """{"base" | "merged1" | "merged2": (greedy tokens, their logprobs) per prompt}, from plain engines."""
    from halserve import LLM

    results = {}
    for key in ("base", "merged1", "merged2"):
        llm = LLM(getattr(lora_models, key), **ENGINE_KWARGS)
        outs = llm.generate(prompt_dicts(lora_models.prompts), greedy(logprobs=0), use_tqdm=False)
        results[key] = (token_ids(outs), [sampled_logprobs(o) for o in outs])
        llm.llm_engine.shutdown()
    return results

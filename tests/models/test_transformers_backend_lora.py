"""LoRA on the Transformers modeling backend (``--model-impl transformers``): adapters in PEFT's format on
transformers' linear layers give the tokens of the native path with the same adapter (Llama), and of
transformers + peft (OLMo 2, no native code), in batches that mix adapters and the base model (float32, CPU)."""
from __future__ import annotations

import random

import pytest
import torch
from lora_factory import make_adapter
from model_factory import make_checkpoint
from test_transformers_backend import FALLBACK, make_hf_checkpoint

ENGINE = dict(platform="cpu", dtype="float32", block_size=16, max_num_batched_tokens=32, enable_lora=True,
              max_loras=2, max_lora_rank=8)
NEW_TOKENS = 8


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 21, 40)]


def _generate(path: str, loras: list, **kwargs) -> list[list[int]]:
    """Greedy tokens of every prompt under each of ``loras`` (None: the base model), all in one batch."""
    from halserve import LLM, SamplingParams

    llm = LLM(path, **(ENGINE | kwargs))
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for _ in loras for p in prompts], params, use_tqdm=False,
                            lora_request=[lora for lora in loras for _ in prompts])
        assert llm.llm_engine.model_info.model_impl == kwargs.get("model_impl", "auto").replace("auto", "transformers")
    finally:
        llm.llm_engine.shutdown()
    tokens = [o.outputs[0].token_ids for o in outs]
    return [tokens[i:i + len(prompts)] for i in range(0, len(tokens), len(prompts))]


def _peft_greedy(path: str, adapter: str) -> list[list[int]]:
    peft = pytest.importorskip("peft", reason="transformers + peft is the reference for the fallback's adapter")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, adapter).eval()
    outs = []
    with torch.inference_mode():
        for ids in _prompts():
            x = torch.tensor([ids])
            y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                               do_sample=False, pad_token_id=0, eos_token_id=None)
            outs.append(y[0, len(ids):].tolist())
    return outs


def test_lora_through_transformers_matches_native_llama(tmp_path):
    """q/k/v/o and the MLP adapted (two adapters, one of rank 4 on q/v only) beside base-model requests."""
    from halserve import LoRARequest

    base = make_checkpoint(tmp_path / "llama", "llama", attention_bias=True)
    loras = [None, LoRARequest("a1", 1, make_adapter(tmp_path / "a1", base, r=8, seed=1)),
             LoRARequest("a2", 2, make_adapter(tmp_path / "a2", base, r=4, lora_alpha=8, seed=2,
                                               target_modules=("q_proj", "v_proj"), use_rslora=True))]
    got = _generate(base, loras, model_impl="transformers")
    assert got == _generate(base, loras, model_impl="halserve")
    assert got[1] != got[0] and got[2] != got[0], "the adapters should change the greedy tokens"


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])  # (2: two spawned ranks)
def test_lora_on_a_fallback_architecture_matches_peft(tmp_path, tp):
    """OLMo 2 (no native code; on two ranks its q/k/v gather their outputs and o_proj splits its input)."""
    from halserve import LoRARequest

    config_name, arch, overrides = FALLBACK["olmo2"]
    base = make_hf_checkpoint(tmp_path / "olmo2", config_name, arch, **overrides)
    adapter = make_adapter(tmp_path / "a1", base, r=8, seed=1)
    got = _generate(base, [LoRARequest("a1", 1, adapter), None], tensor_parallel_size=tp)
    assert got[0] == _peft_greedy(base, adapter)
    assert got[0] != got[1], "the adapter should change the greedy tokens"

"""Speculation with LoRA adapters: the drafts are checked by the adapted model (each request's
own adapter, mixed in one batch), so outputs equal those without speculation."""
from __future__ import annotations

import random

import pytest

from halserve import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')

KW = dict(platform="cpu", dtype="float32", max_model_len=96, block_size=8, num_kv_blocks=120, enable_lora=True,
          max_loras=2, max_lora_rank=8)


def test_mixed_adapters_with_ngram_drafts_match_no_speculation(tmp_path):
    from lora_factory import make_adapter
    from model_factory import make_checkpoint

    base = make_checkpoint(str(tmp_path / "base"), "llama", layer_scale=0.6)
    loras = [LoRARequest(f"a{i}", i + 1, make_adapter(tmp_path / f"a{i}", base, r=8, seed=i)) for i in range(2)]
    rng = random.Random(2)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(n)]} for n in (3, 9, 17, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    per_prompt = [loras[0], loras[1], None, loras[0]]

    def run(llm):
        outs = llm.generate(prompts, params, lora_request=per_prompt, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    plain = LLM(base, **KW)
    want = run(plain)
    without_adapters = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    plain.llm_engine.shutdown()
    spec = LLM(base, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                         "prompt_lookup_min": 1}, **KW)
    try:
        got = run(spec)
        stats = spec.llm_engine.core.get_stats()
    finally:
        spec.llm_engine.shutdown()
    assert got == want
    assert all((w != b) == (lora is not None) for w, b, lora in zip(want, without_adapters, per_prompt))
    assert stats.spec_num_accepted_tokens > 0

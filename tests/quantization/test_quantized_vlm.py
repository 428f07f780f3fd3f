"""A quantized vision-language checkpoint (llm-compressor's usual recipe: the decoder in W4A16, the
vision tower, projector and head left in floats): greedy output with images token-identical to
transformers loading the same checkpoint."""
from __future__ import annotations

import os
import sys

import pytest
from mm_factory import make_llava_checkpoint
from quant_factory import make_ct_checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "multimodal"))
from test_llava_engine import PROMPTS, greedy, hf_reference, images_for, make_llm, request  # noqa: E402

pytestmark = pytest.mark.slow  # a quantized LLaVA against transformers, ~25 s (inner loop: -m 'not slow')

IGNORE = ["re:.*lm_head", "re:.*vision_tower.*", "re:.*multi_modal_projector.*"]


def test_w4a16_llava_matches_transformers(tmp_path, reference_4bit_kernels):
    base = make_llava_checkpoint(tmp_path / "llava")
    path, _ = make_ct_checkpoint(base, str(tmp_path / "w4a16"), "W4A16", ignore=IGNORE)
    expected = [hf_reference(path, text, images_for(i, n)) for i, (text, n) in enumerate(PROMPTS)]
    llm = make_llm(path, max_num_batched_tokens=24)
    try:
        outputs = llm.generate([request(i) for i in range(len(PROMPTS))], greedy(), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [want for _, want in expected]

"""Qwen2-VL and Qwen2.5-VL through the whole engine: images of different sizes (so different
placeholder counts), M-RoPE positions for prompts and generated tokens; greedy output token-identical
to transformers' ``generate`` under chunked prefill, preemption and tensor/pipeline parallelism."""
from __future__ import annotations

import pytest
import torch
from mm_factory import make_image, make_qwen2_vl_checkpoint, qwen2_vl_processor

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')

NEW_TOKENS = 10
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPTS = [  # (text, image sizes); prompts of 19, 23, 35 and 42 tokens
    ("<|user|>\nA story about a small red dog, once upon a time.<|assistant|>\n", []),
    (f"{IMAGE}{IMAGE}what", [(80, 80), (200, 40)]),  # (two images back to back)
    (f"<|user|>\n{IMAGE}Describe the quick brown fox in this picture.<|assistant|>\n", [(60, 90)]),
    (f"<|user|>\nCompare {IMAGE} with {IMAGE} please, the two of them.<|assistant|>\n", [(120, 70), (50, 50)]),
]
VARIANTS = {
    "default": dict(),
    "tiny_chunks": dict(max_num_batched_tokens=8),
    # 5 usable blocks of 16 for prompts of 19-42 tokens growing by 10
    "preempt": dict(num_kv_blocks=6),
}


@pytest.fixture(scope="module", params=["2", "2.5"])
def qwen_vl(request, tmp_path_factory):
    version = request.param
    path = make_qwen2_vl_checkpoint(tmp_path_factory.mktemp(f"qwen{version}vl"), version=version)
    return path, [hf_reference(path, version, text, images_for(i)) for i, (text, _) in enumerate(PROMPTS)]


def images_for(index: int) -> list:
    return [make_image(10 * index + j, size=size) for j, size in enumerate(PROMPTS[index][1])]


def hf_reference(path: str, version: str, text: str, images: list) -> tuple[list[int], list[int]]:
    import transformers

    name = "Qwen2VLForConditionalGeneration" if version == "2" else "Qwen2_5_VLForConditionalGeneration"
    model = getattr(transformers, name).from_pretrained(path, dtype=torch.float32).eval()
    inputs = qwen2_vl_processor(path)(text=[text], images=images or None, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids):].tolist()


def request(index: int) -> dict:
    prompt = {"prompt": PROMPTS[index][0]}
    if PROMPTS[index][1]:
        prompt["multi_modal_data"] = {"image": images_for(index)}
    return prompt


def run(path: str, **kwargs):
    from halserve import LLM, SamplingParams

    llm = LLM(path, platform="cpu", dtype="float32", block_size=16, max_model_len=256, **kwargs)
    try:
        outputs = llm.generate([request(i) for i in range(len(PROMPTS))],
                               SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
        return outputs, llm.llm_engine.get_stats()
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers(qwen_vl, variant):
    path, expected = qwen_vl
    outputs, stats = run(path, **({"max_num_batched_tokens": 64} | VARIANTS[variant]))
    for out, (want_prompt, want) in zip(outputs, expected):
        assert out.prompt_token_ids == want_prompt  # (each image's own number of placeholders)
        assert out.outputs[0].token_ids == want
    if variant == "preempt":
        assert stats.num_preemptions > 0, "the tiny cache should have forced preemption"


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp2", "pp2"])
def test_parallel_matches_transformers(qwen_vl, parallel):
    path, expected = qwen_vl
    outputs, _ = run(path, max_num_batched_tokens=24, **parallel)
    assert [o.outputs[0].token_ids for o in outputs] == [want for _, want in expected]


def test_mm_processor_kwargs(qwen_vl):
    """vLLM's mm_processor_kwargs: Qwen2-VL's max_pixels shrinks the image (fewer tokens), as the same
    setting does for transformers' processor; a key that changes nothing is an error at start-up."""
    from transformers import AutoImageProcessor

    from halserve import LLM, SamplingParams

    path, _ = qwen_vl
    image = make_image(7, size=(400, 300))
    small = AutoImageProcessor.from_pretrained(path, max_pixels=16 * 28 * 28)(images=[image], return_tensors="pt")
    default = AutoImageProcessor.from_pretrained(path)(images=[image], return_tensors="pt")
    want = int(small["image_grid_thw"].prod()) // 4
    assert want < int(default["image_grid_thw"].prod()) // 4
    llm = LLM(path, platform="cpu", dtype="float32", max_model_len=256, mm_processor_kwargs='{"max_pixels": 12544}')
    try:
        out = llm.generate([{"prompt": f"{IMAGE}what", "multi_modal_data": {"image": image}}],
                           SamplingParams(max_tokens=2), use_tqdm=False)[0]
        image_id = llm.llm_engine.model_info.image_token_id
    finally:
        llm.llm_engine.shutdown()
    assert out.prompt_token_ids.count(image_id) == want
    with pytest.raises(ValueError, match="change nothing in the checkpoint's"):
        LLM(path, platform="cpu", mm_processor_kwargs={"max_pixls": 12544})

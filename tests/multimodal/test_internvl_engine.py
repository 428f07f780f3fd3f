"""InternVL through the whole engine: images with different tile counts (so different placeholder counts), each
wrapped in <img> ... </img> by the engine's expansion, tiled although the checkpoint's preprocessor config says
``crop_to_patches: false`` (as ``InternVLProcessor`` does); prompt ids and greedy output token-identical to
transformers' processor and ``generate``, whole and in 8-token chunks (an image's rows fed over many steps)."""
from __future__ import annotations

import pytest
import torch
from mm_factory import internvl_processor, make_image, make_internvl_checkpoint

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')

NEW_TOKENS = 10
PROMPTS = [  # (text, image sizes (width, height))
    ("<|user|>\n<IMG_CONTEXT>\nDescribe the quick brown fox in this picture.<|assistant|>\n", [(200, 60)]),  # 3x1 + 1
    ("<|user|>\nCompare <IMG_CONTEXT>\nwith <IMG_CONTEXT>\nplease, the two of them.<|assistant|>\n",
     [(50, 180), (40, 30)]),  # 1x4 + 1 tiles, then a single tile
    ("<|user|>\nA story about a small red dog, once upon a time.<|assistant|>\n", []),
]
VARIANTS = {
    "default": dict(),
    "tiny_chunks": dict(max_num_batched_tokens=8),
    "tp2": dict(tensor_parallel_size=2, max_num_batched_tokens=32),
    "pp2": dict(pipeline_parallel_size=2, max_num_batched_tokens=32),
}


def images_for(index: int) -> list:
    return [make_image(10 * index + j, size=size) for j, size in enumerate(PROMPTS[index][1])]


@pytest.fixture(scope="module")
def internvl(tmp_path_factory):
    from transformers import InternVLForConditionalGeneration

    path = make_internvl_checkpoint(tmp_path_factory.mktemp("internvl"))
    processor = internvl_processor(path)
    model = InternVLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    for i, (text, _) in enumerate(PROMPTS):
        inputs = processor(text=text, images=images_for(i) or None, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        ids = inputs["input_ids"][0].tolist()
        expected.append((ids, out[0, len(ids):].tolist()))
    return path, expected, processor.image_token_id


def request(index: int) -> dict:
    prompt = {"prompt": PROMPTS[index][0]}
    if PROMPTS[index][1]:
        prompt["multi_modal_data"] = {"image": images_for(index)}
    return prompt


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers(internvl, variant):
    from halserve import LLM, SamplingParams

    path, expected, image_token = internvl
    llm = LLM(path, platform="cpu", dtype="float32", block_size=16, max_model_len=256, **VARIANTS[variant])
    try:
        outputs = llm.generate([request(i) for i in range(len(PROMPTS))],
                               SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert llm.llm_engine.model_info.image_token_id == image_token
    assert [want.count(image_token) for want, _ in expected] == [4 * 4, 4 * 5 + 4 * 1, 0]  # 4 tokens a tile
    for out, (want_prompt, want) in zip(outputs, expected):
        assert out.prompt_token_ids == want_prompt  # (<img>, each image's own number of placeholders, </img>)
        assert out.outputs[0].token_ids == want

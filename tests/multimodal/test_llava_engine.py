"""Images through the whole engine (LLaVA): greedy output token-identical to transformers'
``LlavaForConditionalGeneration.generate`` whatever the chunking, caching and preemption; the
prefix cache tells images apart; bad image input is refused clearly."""
from __future__ import annotations

import pytest
import torch
from mm_factory import make_image, make_llava_checkpoint

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')

NEW_TOKENS = 12
PROMPTS = [  # (text, number of images)
    ("<|user|>\n<image>\nDescribe the quick brown fox in this picture.<|assistant|>\n", 1),
    ("<|user|>\nTell me about <image> and then <image> please, the two of them.<|assistant|>\n", 2),
    ("<image>\nwhat", 1),
    ("<|user|>\nA story about a small red dog, once upon a time.<|assistant|>\n", 0),
]
VARIANTS = {
    "default": dict(),
    "no_prefix_cache": dict(enable_prefix_caching=False),
    # 8-token chunks: every image's 16 placeholders are fed over two or three steps
    "tiny_chunks": dict(max_num_batched_tokens=8),
    # 7 usable blocks of 16 for 4 requests of up to ~70 tokens: preemption, then recomputed images
    "preempt": dict(num_kv_blocks=8),
}


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return make_llava_checkpoint(tmp_path_factory.mktemp("llava"))


def images_for(index: int, count: int) -> list:
    return [make_image(10 * index + j, size=(40 + 7 * j, 30 + 5 * index)) for j in range(count)]


def hf_reference(path: str, text: str, images: list, max_new_tokens: int = NEW_TOKENS) -> tuple[list[int], list[int]]:
    """(transformers' expanded prompt ids, its greedy continuation)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(path)
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=0,
                             eos_token_id=None, pad_token_id=0)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def expected(llava):
    return [hf_reference(llava, text, images_for(i, n)) for i, (text, n) in enumerate(PROMPTS)]


def request(index: int):
    text, count = PROMPTS[index]
    prompt = {"prompt": text}
    if count:
        prompt["multi_modal_data"] = {"image": images_for(index, count) if count > 1 else images_for(index, 1)[0]}
    return prompt


def greedy(max_tokens: int = NEW_TOKENS):
    from halserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def make_llm(path: str, **kwargs):
    from halserve import LLM

    return LLM(path, platform="cpu", dtype="float32", block_size=16, max_model_len=256, **kwargs)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers(llava, expected, variant):
    llm = make_llm(llava, **({"max_num_batched_tokens": 64} | VARIANTS[variant]))
    try:
        outputs = llm.generate([request(i) for i in range(len(PROMPTS))], greedy(), use_tqdm=False)
        stats = llm.llm_engine.get_stats()
    finally:
        llm.llm_engine.shutdown()
    for out, (want_prompt, want) in zip(outputs, expected):
        assert out.prompt_token_ids == want_prompt  # (the placeholders expanded as transformers' processor does)
        assert out.outputs[0].token_ids == want
    if variant == "preempt":
        assert stats.num_preemptions > 0, "the tiny cache should have forced preemption"


def test_prefix_cache_tells_images_apart(llava):
    """The same text with another image shares only the blocks before the image; the same image
    again hits the cache through it, with the same output."""
    text = "<|user|>\nA long question about a small red dog, once upon a time, in this picture: <image>\nwhat?"
    first, second = make_image(101), make_image(102)
    llm = make_llm(llava)
    try:
        runs = [llm.generate([{"prompt": text, "multi_modal_data": {"image": img}}], greedy(), use_tqdm=False)[0]
                for img in (first, second, first)]
    finally:
        llm.llm_engine.shutdown()
    image_start = runs[0].prompt_token_ids.index(llm.llm_engine.model_info.image_token_id)
    assert image_start >= 16  # (at least one block of text before the image)
    assert runs[1].num_cached_tokens == image_start // 16 * 16  # the text's full blocks only
    assert runs[2].num_cached_tokens >= (len(runs[2].prompt_token_ids) - 1) // 16 * 16 > image_start
    for out, img in zip(runs, (first, second, first)):
        assert out.outputs[0].token_ids == hf_reference(llava, text, [img])[1]
    assert runs[0].outputs[0].token_ids != runs[1].outputs[0].token_ids


def test_placeholders_written_out_and_token_prompts(llava, expected):
    """A prompt may give each image's placeholder once (expanded) or already written out in full, as
    text or token ids: the same request."""
    want_prompt, want = expected[0]
    image = images_for(0, 1)[0]
    llm = make_llm(llava)
    try:
        prompts = [{"prompt_token_ids": want_prompt, "multi_modal_data": {"image": image}},
                   {"prompt_token_ids": llm.get_tokenizer().encode(PROMPTS[0][0]), "multi_modal_data": {"image": [image]}}]
        outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    for out in outputs:
        assert out.prompt_token_ids == want_prompt and out.outputs[0].token_ids == want


def test_bad_image_input_is_refused_and_the_engine_goes_on(llava, expected):
    llm = make_llm(llava)
    image = make_image(0)
    bad = [
        ({"prompt": "<image> and <image>", "multi_modal_data": {"image": image}}, "has 2 image placeholder tokens .* for 1 image"),
        ({"prompt": "no placeholder", "multi_modal_data": {"image": image}}, "has 0 image placeholder tokens"),
        ({"prompt": "<image>", "multi_modal_data": {"image": "cat.png"}}, "PIL.Image.Image"),
        ({"prompt": "<image>", "multi_modal_data": {"video": image}}, "takes only 'image'"),
        ({"prompt": "<image>", "multi_modal_data": {"image": []}}, "empty"),
    ]
    try:
        for prompt, message in bad:
            with pytest.raises(ValueError, match=message):
                llm.generate([prompt], greedy(), use_tqdm=False)
        from halserve import SamplingParams

        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            llm.generate([request(0)], SamplingParams(max_tokens=2, truncate_prompt_tokens=8), use_tqdm=False)
        from halserve.beam_search import BeamSearchParams

        with pytest.raises(ValueError, match="beam search"):
            llm.beam_search([request(0)], BeamSearchParams(beam_width=2, max_tokens=2))
        out = llm.generate([request(0)], greedy(), use_tqdm=False)[0]  # the engine still serves
        assert out.outputs[0].token_ids == expected[0][1]
    finally:
        llm.llm_engine.shutdown()


def test_text_model_refuses_images(tmp_path):
    from model_factory import make_checkpoint

    llm = make_llm(make_checkpoint(tmp_path / "text"))
    try:
        with pytest.raises(ValueError, match="takes no images"):
            llm.generate([{"prompt": "hi", "multi_modal_data": {"image": make_image(0)}}], greedy(), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


def test_draft_model_is_refused(llava):
    with pytest.raises(ValueError, match="draft model cannot speculate"):
        make_llm(llava, speculative_config={"model": llava, "num_speculative_tokens": 2})


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp2", "pp2"])
def test_parallel_matches_transformers(llava, expected, parallel):
    llm = make_llm(llava, max_num_batched_tokens=24, **parallel)
    try:
        outputs = llm.generate([request(i) for i in range(len(PROMPTS))], greedy(), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [want for _, want in expected]


def test_ngram_speculation_and_structured_outputs_with_images(llava, expected):
    """Prompt-lookup drafts leave greedy output unchanged with images in the prompts; a regex
    constraint holds for a request with an image."""
    from halserve import SamplingParams
    from halserve.structured_output import StructuredOutputsParams

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    llm = make_llm(llava, speculative_config=spec)
    try:
        outputs = llm.generate([request(i) for i in range(len(PROMPTS))], greedy(), use_tqdm=False)
        constrained = llm.generate([request(0)], SamplingParams(
            temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="(yes|no)")),
            use_tqdm=False)[0]
    finally:
        llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [want for _, want in expected]
    assert constrained.outputs[0].text in ("yes", "no")


def test_an_image_shared_by_requests_is_encoded_once(llava, expected):
    """n samples of one prompt (scheduled together, so the prefix cache cannot help yet) and a second
    request with the same image run the vision tower on it once."""
    from halserve import SamplingParams

    llm = make_llm(llava)
    runner = llm.llm_engine.core.executor.worker.model_runner
    calls = []
    encode = runner.model.embed_multimodal
    runner.model.embed_multimodal = lambda items: calls.append(len(items)) or encode(items)
    try:
        outs = llm.generate([request(0), request(0)], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4),
                            use_tqdm=False)
        again = llm.generate([request(0)], greedy(), use_tqdm=False)[0]
    finally:
        llm.llm_engine.shutdown()
    assert calls == [1]  # (the third request hits the prefix cache past the image)
    assert [len(out.outputs) for out in outs] == [3, 3]
    assert again.outputs[0].token_ids == expected[0][1]


def test_limit_mm_per_prompt(llava):
    """vLLM's limit_mm_per_prompt: more images than the limit, or any with a limit of 0, are refused."""
    from halserve import LLM

    two = {"prompt": PROMPTS[1][0], "multi_modal_data": {"image": images_for(1, 2)}}
    for limit, message in ((1, "at most 1 images .*got 2"), (0, "takes no images")):
        llm = make_llm(llava, limit_mm_per_prompt=f'{{"image": {limit}}}')
        try:
            with pytest.raises(ValueError, match=message):
                llm.generate([two], greedy(), use_tqdm=False)
            if limit:
                assert llm.generate([request(0)], greedy(2), use_tqdm=False)[0].outputs[0].token_ids
        finally:
            llm.llm_engine.shutdown()
    for bad, message in (({"image": -1}, "integer >= 0"), ({"audio": 1}, "'audio' inputs are not supported")):
        with pytest.raises(ValueError, match=message):
            LLM(llava, limit_mm_per_prompt=bad)

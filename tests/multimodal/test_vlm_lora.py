"""LoRA adapters on a vision-language model's decoder (PEFT's format, as trained on transformers'
``LlavaForConditionalGeneration``): greedy output with an image equals PeftModel's; an adapter of the
vision tower is refused clearly."""
from __future__ import annotations

import pytest
import torch
from mm_factory import make_image, make_llava_checkpoint

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')

PROMPT = "<|user|>\n<image>\nDescribe the quick brown fox in this picture.<|assistant|>\n"
NEW_TOKENS = 10
DECODER = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def make_vlm_adapter(base: str, out_dir, target_modules, seed: int = 0):
    """A PEFT adapter of ``target_modules`` with random A and B (B is zeros after PEFT's init), saved;
    returns (its directory, the PeftModel)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=target_modules))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    peft_model.save_pretrained(str(out_dir))
    return str(out_dir), peft_model.eval()


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return make_llava_checkpoint(tmp_path_factory.mktemp("llava"))


def test_decoder_adapter_matches_peft(llava, tmp_path):
    from transformers import AutoProcessor

    from halserve import LLM, LoRARequest, SamplingParams

    adapter, peft_model = make_vlm_adapter(llava, tmp_path / "adapter", DECODER)
    image = make_image(3)
    inputs = AutoProcessor.from_pretrained(llava)(text=PROMPT, images=[image], return_tensors="pt")
    with torch.inference_mode():
        out = peft_model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
    want = out[0, inputs["input_ids"].shape[1]:].tolist()
    llm = LLM(llava, platform="cpu", dtype="float32", max_model_len=256, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": image}}
    try:
        adapted = llm.generate([prompt], params, lora_request=LoRARequest("vlm", 1, adapter), use_tqdm=False)[0]
        base = llm.generate([prompt], params, use_tqdm=False)[0]
    finally:
        llm.llm_engine.shutdown()
    assert adapted.outputs[0].token_ids == want
    assert base.outputs[0].token_ids != want  # (the adapter matters)


def test_vision_tower_adapter_is_refused(llava, tmp_path):
    from halserve import LLM, LoRARequest, SamplingParams

    adapter, _ = make_vlm_adapter(llava, tmp_path / "vision", r".*vision_tower.*\.(q_proj|v_proj)")
    llm = LLM(llava, platform="cpu", dtype="float32", max_model_len=256, enable_lora=True, max_lora_rank=8)
    try:
        with pytest.raises(ValueError, match="vision_tower.*does not have as a LoRA-able layer"):
            llm.generate(["hello"], SamplingParams(max_tokens=2), lora_request=LoRARequest("v", 2, adapter),
                         use_tqdm=False)
        assert llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.llm_engine.shutdown()

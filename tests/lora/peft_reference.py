"""References for LoRA on the newer model families, made by PEFT and transformers themselves:

    adapter, merged = make_peft_adapter(base, tmp / "adapter", tmp / "merged", ["qkv_proj", "o_proj"])
    tokens, logprobs = hf_greedy_logprobs(merged, prompts)       # transformers on the merged model
    tokens, logprobs = halserve_greedy(merged, prompts)          # halserve on the merged model

``make_peft_adapter`` wraps the base checkpoint's HF model with ``get_peft_model`` (so the
module names, shapes and fused layouts are what PEFT writes for that architecture), gives A
and B random non-zero values (PEFT starts B at zero, which would adapt nothing), saves the
adapter, and saves ``merge_and_unload()`` of the same model as a checkpoint beside it.
"""
from __future__ import annotations

import os
import shutil

import torch
from lora_factory import ENGINE_KWARGS, NEW_TOKENS, greedy, prompt_dicts, sampled_logprobs, token_ids

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def make_peft_adapter(base: str, adapter_dir, merged_dir, target_modules: list[str], *, r: int = 8,
                      lora_alpha: float = 16, seed: int = 0) -> tuple[str, str]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=0.0, target_modules=list(target_modules),
                        task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # x A^T ~1 per entry, scaling * (x A^T) B^T ~0.5: a clear change, still a sane model
            if "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.25 / r**0.5)
    adapter_dir, merged_dir = os.fspath(adapter_dir), os.fspath(merged_dir)
    model.save_pretrained(adapter_dir)
    model.merge_and_unload().save_pretrained(merged_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(base, name)):
            shutil.copy(os.path.join(base, name), merged_dir)
    return adapter_dir, merged_dir


def adapter_modules(adapter_dir: str) -> set[str]:
    """The module names (without PEFT's prefix) an adapter file holds weights for."""
    from safetensors import safe_open

    with safe_open(os.path.join(adapter_dir, "adapter_model.safetensors"), framework="pt") as f:
        return {key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for key in f.keys()}


def hf_greedy_logprobs(path: str, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy tokens and their logprobs, one prompt at a time, eos disabled."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    tokens, logprobs = [], []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            new = out.sequences[0, len(ids):].tolist()
            steps = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)  # [NEW_TOKENS, vocab]
            tokens.append(new)
            logprobs.append([float(steps[i, t]) for i, t in enumerate(new)])
    return tokens, logprobs


def halserve_greedy(path: str, prompts: list[list[int]], **engine_kwargs):
    """halserve's greedy tokens and logprobs on a plain engine (no LoRA)."""
    from halserve import LLM

    llm = LLM(path, **(ENGINE_KWARGS | engine_kwargs))
    try:
        outs = llm.generate(prompt_dicts(prompts), greedy(logprobs=0), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    return token_ids(outs), [sampled_logprobs(o) for o in outs]

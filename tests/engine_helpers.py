"""Helpers for engine tests: model families, prompt lengths, transformers' greedy output."""
from __future__ import annotations

import pytest
import torch

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]

# Architecture-specific extras that make each family exercise its own code paths.
ARCH_OVERRIDES = {
    "llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(sliding_window=48),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=32),
}


def prompt_lengths(block_size: int, max_num_batched_tokens: int) -> list[int]:
    """1 token; under one block; exactly one block; several blocks; longer than the
    per-step token budget (so prefill is chunked); and a few in between."""
    return [1, block_size - 3, block_size, 3 * block_size + 5, max_num_batched_tokens + 37, 7, 2 * block_size + 1, 23]


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding), eos disabled."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                min_new_tokens=0, pad_token_id=0,
            )
            outs.append(y[0, len(ids):].tolist())
    return outs

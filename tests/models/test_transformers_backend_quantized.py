"""Quantized checkpoints on the Transformers modeling backend: transformers' linear layers become halserve's,
built by the checkpoint's quant method under the checkpoint's own names, so a GPTQ or fp8 checkpoint loads
unchanged. Llama through ``--model-impl transformers`` gives the native path's tokens on the same quantized
checkpoint; OLMo 2 (no native code) gives transformers' tokens on the float weights its GPTQ tensors stand for."""
from __future__ import annotations

import random

import pytest
import torch
from model_factory import make_checkpoint
from quant_factory import dequantized_hf_model, make_fp8_checkpoint, make_gptq_checkpoint
from test_transformers_backend import FALLBACK, make_hf_checkpoint

NEW_TOKENS = 8
ENGINE = dict(platform="cpu", dtype="float32", block_size=16, max_num_batched_tokens=16)
BUILDERS = {"gptq": make_gptq_checkpoint, "fp8": make_fp8_checkpoint}


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (4, 19, 37)]


def _generate(path: str, **kwargs) -> tuple[list[list[int]], object]:
    from halserve import LLM, SamplingParams

    llm = LLM(path, **(ENGINE | kwargs))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def _method_of_q_proj(llm) -> str:
    model = llm.llm_engine.core.executor.worker.model_runner.model  # (the uni executor: in this process)
    return model.model.layers[0].self_attn.q_proj.quant_method.name


@pytest.mark.parametrize("method", [pytest.param("gptq", marks=pytest.mark.slow), "fp8"])  # (gptq: the fallback's below)
def test_quantized_llama_through_transformers_matches_native(tmp_path, method):
    base = make_checkpoint(tmp_path / "llama", "llama")
    path, _ = BUILDERS[method](base, str(tmp_path / method))
    got, llm = _generate(path, model_impl="transformers")
    assert llm.llm_engine.model_info.model_impl == "transformers"
    assert _method_of_q_proj(llm) == method
    native, _ = _generate(path, model_impl="halserve")
    assert got == native


def test_gptq_fallback_architecture_matches_its_dequantized_transformers_model(tmp_path, monkeypatch):
    # the reference 4-bit GEMM (dequantize, then a float32 matmul; inherited by spawned ranks): the CPU's own
    # 4-bit kernel computes in bf16, enough to swap two near-tied greedy tokens of a random model
    monkeypatch.setenv("HALSERVE_KERNELS", "gptq_gemm=torch")
    config_name, arch, overrides = FALLBACK["olmo2"]
    base = make_hf_checkpoint(tmp_path / "olmo2", config_name, arch, **overrides)
    path, dequantized = make_gptq_checkpoint(base, str(tmp_path / "gptq"))
    got, llm = _generate(path)  # model_impl "auto": the fallback
    assert llm.llm_engine.model_info.model_impl == "transformers"
    assert _method_of_q_proj(llm) == "gptq"
    model = dequantized_hf_model(base, dequantized)
    expected = []
    with torch.inference_mode():
        for ids in _prompts():
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
                               pad_token_id=0, eos_token_id=None)
            expected.append(y[0, len(ids):].tolist())
    assert got == expected

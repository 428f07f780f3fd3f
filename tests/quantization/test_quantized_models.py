"""Quantized checkpoints, each in its tool's own format, give the logits of the float model they
stand for, token for token through the paged cache (prefill, then batched decodes).

References, independent of halserve where a library can be one:
- compressed-tensors W4A16 and FP8: transformers loading the checkpoint with compressed-tensors
  (which fake-quantizes FP8 activations as the checkpoint says);
- compressed-tensors W4A16_ASYM: compressed-tensors' own dequantization (transformers 5.23 cannot
  load asymmetric packed zero points);
- W8A8 int8: compressed-tensors' dequantized weights with activations fake-quantized per token at
  amax / 127 (vLLM's and halserve's scale; transformers' fake quantization uses amax / 127.5);
- GPTQ, AWQ, fp8: the weights the tensors stand for (packing as in AutoGPTQ / AutoAWQ), with fp8
  activations fake-quantized as the checkpoint says.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from quant_factory import (
    dequantized_hf_model,
    load_halserve,
    make_awq_checkpoint,
    make_ct_checkpoint,
    make_fp8_checkpoint,
    make_gptq_checkpoint,
)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models"))
from paged_harness import PagedHarness  # noqa: E402

PROMPTS = [[1, 45, 74, 299, 17, 273, 5, 9, 100], [1, 300, 2, 9], [1, 100, 101, 102, 103]]
FP8 = torch.float8_e4m3fn


def per_token(qdq):
    """A forward pre-hook applying ``qdq`` (fake quantization) to a linear's input."""
    return lambda module, args: (qdq(args[0]),)


def int8_per_token(x):
    s = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12)
    return torch.round(x / s).clamp(-128, 127) * s


def fp8_per_token(x):
    s = (x.abs().amax(-1, keepdim=True) / torch.finfo(FP8).max).clamp(min=1e-12)
    return (x / s).to(FP8).float() * s


def fp8_static(scale: float):
    fmax = torch.finfo(FP8).max
    return lambda x: (x / scale).clamp(-fmax, fmax).to(FP8).float() * scale


def fp8_per_group(group: int):
    def qdq(x):
        g = x.reshape(*x.shape[:-1], -1, group)
        return fp8_per_token(g).reshape(x.shape)
    return qdq


def run_steps(model, decode_steps: int = 3) -> torch.Tensor:
    """Logits of one flattened prefill of PROMPTS and of ``decode_steps`` batched greedy decodes."""
    from halserve.attention_backends.torch_ref import TorchAttentionBackend

    harness = PagedHarness(model, TorchAttentionBackend)
    logits = [harness.step([(f"r{i}", p) for i, p in enumerate(PROMPTS)])]
    ends = torch.tensor([len(p) for p in PROMPTS]).cumsum(0) - 1
    last = logits[0][ends].argmax(-1).tolist()
    for _ in range(decode_steps):
        step = harness.step([(f"r{i}", [t]) for i, t in enumerate(last)])
        logits.append(step)
        last = step.argmax(-1).tolist()
    return torch.cat(logits)


def reference_steps(hf, decode_steps: int = 3) -> torch.Tensor:
    """The same steps with a transformers model, one prompt at a time (greedy tokens from its own logits)."""
    prefill, per_prompt = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            logits = hf(torch.tensor([prompt])).logits[0]
            prefill.append(logits)
            ids, steps = list(prompt), []
            for _ in range(decode_steps):
                ids.append(int(logits[-1].argmax()))
                logits = hf(torch.tensor([ids])).logits[0]
                steps.append(logits[-1])
            per_prompt.append(steps)
    decodes = [torch.stack([per_prompt[i][s] for i in range(len(PROMPTS))]) for s in range(decode_steps)]
    return torch.cat(prefill + decodes)


def transformers_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def with_input_quant(model, names, qdq):
    for name in names:
        model.get_submodule(name).register_forward_pre_hook(per_token(qdq))
    return model


# name -> (checkpoint builder, reference builder(base, out, dequantized), halserve method name of a layer)
CASES = {
    "gptq": (lambda b, o: make_gptq_checkpoint(b, o), None, "gptq"),
    "gptq-act-order": (lambda b, o: make_gptq_checkpoint(b, o, desc_act=True), None, "gptq"),
    "gptq-per-channel": (lambda b, o: make_gptq_checkpoint(b, o, group_size=-1), None, "gptq"),
    "awq": (lambda b, o: make_awq_checkpoint(b, o), None, "awq"),
    "ct-w4a16": (lambda b, o: make_ct_checkpoint(b, o, "W4A16"), lambda b, o, d: transformers_model(o),
                 "compressed-tensors"),
    "ct-w4a16-asym": (lambda b, o: make_ct_checkpoint(b, o, "W4A16_ASYM"), None, "compressed-tensors"),
    "ct-w8a8-int8": (lambda b, o: make_ct_checkpoint(b, o, "W8A8"),
                     lambda b, o, d: with_input_quant(dequantized_hf_model(b, d), d, int8_per_token),
                     "compressed-tensors"),
    "ct-fp8-static": (lambda b, o: make_ct_checkpoint(b, o, "FP8"), lambda b, o, d: transformers_model(o),
                      "compressed-tensors"),
    "ct-fp8-dynamic": (lambda b, o: make_ct_checkpoint(b, o, "FP8_DYNAMIC"), lambda b, o, d: transformers_model(o),
                       "compressed-tensors"),
    "ct-fp8-block": (lambda b, o: make_ct_checkpoint(b, o, "FP8_BLOCK"), lambda b, o, d: transformers_model(o),
                     "compressed-tensors"),
    "fp8-dynamic": (lambda b, o: make_fp8_checkpoint(b, o),
                    lambda b, o, d: with_input_quant(dequantized_hf_model(b, d), d, fp8_per_token), "fp8"),
    "fp8-static": (lambda b, o: make_fp8_checkpoint(b, o, static=True),
                   lambda b, o, d: with_input_quant(dequantized_hf_model(b, d), d, fp8_static(8 / 448)), "fp8"),
    "fp8-block": (lambda b, o: make_fp8_checkpoint(b, o, block_size=(32, 32)),
                  lambda b, o, d: with_input_quant(dequantized_hf_model(b, d), d, fp8_per_group(32)), "fp8"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_checkpoint_matches_its_float_model(base, tmp_path, case, reference_4bit_kernels):
    build, reference, method = CASES[case]
    path, dequantized = build(base, str(tmp_path / case))
    model = load_halserve(path)
    layer = model.model.layers[0].self_attn.qkv_proj
    assert layer.quant_method.name == method
    hf = reference(base, path, dequantized) if reference else dequantized_hf_model(base, dequantized)
    torch.testing.assert_close(run_steps(model), reference_steps(hf), atol=tolerance(case), rtol=1e-4)


def tolerance(case: str) -> float:
    """Weight-only formats agree to float rounding. With 8-bit activations a float difference of
    1e-7 can move one activation across an fp8/int8 rounding boundary (a step of up to 1/16 of it),
    which moves the logits by ~1e-4; a wrong scale or layout moves them by 0.1 and more."""
    return 1e-3 if "w8a8" in case or "fp8" in case else 1e-4


def test_online_fp8_quantizes_a_float_checkpoint(base):
    model = load_halserve(base, quantization="fp8")
    layer = model.model.layers[0].mlp.down_proj
    assert layer.quant_method.name == "fp8" and layer.weight.dtype == FP8
    hf = transformers_model(base)
    names = [n for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    with torch.no_grad():
        for name in names:  # per output channel, as halserve quantizes at load
            w = hf.get_submodule(name).weight
            s = (w.abs().amax(dim=1, keepdim=True) / torch.finfo(FP8).max).clamp(min=1e-12)
            w.copy_((w / s).to(FP8).float() * s)
    with_input_quant(hf, names, fp8_per_token)
    torch.testing.assert_close(run_steps(model), reference_steps(hf), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("kernel", ["cpu_native", "torch_int4pack"])
def test_cpu_int4_kernels_in_a_model(base, tmp_path, kernel, monkeypatch):
    """The CPU's 4-bit kernels (native_int4.py, and torch's int4 matmul; both in bf16) in a whole model:
    within bf16's error of the exact model, where a wrong zero, scale or group moves the logits by 10%."""
    from halserve.platforms.cpu_kernels.native_int4 import NativeInt4GptqGemm

    reason = NativeInt4GptqGemm.supports(dtype="float32", n=64, k=64, group_size=32)
    if kernel == "cpu_native" and reason is not None:
        pytest.skip(f"the native 4-bit GEMM does not run here: {reason}")
    monkeypatch.setenv("HALSERVE_KERNELS", f"gptq_gemm={kernel},awq_gemm={kernel}")
    for case in ("gptq-act-order", "awq"):
        path, dequantized = CASES[case][0](base, str(tmp_path / case))
        model = load_halserve(path)
        layer = model.model.layers[0].mlp.down_proj
        assert layer.int4_kernel.name == kernel
        want = reference_steps(dequantized_hf_model(base, dequantized))
        got = run_steps(model)
        assert (got - want).abs().max() < 3e-2 * want.abs().max(), case


def test_layers_left_in_floats(base, tmp_path, reference_4bit_kernels):
    """AWQ's modules_to_not_convert and compressed-tensors' ignore (names and re: patterns)."""
    path, dequantized = make_awq_checkpoint(base, str(tmp_path / "awq"), modules_to_not_convert=["down_proj"])
    model = load_halserve(path)
    mlp = model.model.layers[1].mlp
    assert (mlp.down_proj.quant_method.name, mlp.gate_up_proj.quant_method.name) == ("unquantized", "awq")
    torch.testing.assert_close(run_steps(model), reference_steps(dequantized_hf_model(base, dequantized)),
                               atol=1e-4, rtol=1e-4)

    path, dequantized = make_ct_checkpoint(base, str(tmp_path / "ct"), "W4A16", ignore=["lm_head", "re:.*self_attn.*"])
    model = load_halserve(path)
    attn = model.model.layers[0].self_attn
    assert (attn.qkv_proj.quant_method.name, attn.o_proj.quant_method.name) == ("unquantized", "unquantized")
    assert model.model.layers[0].mlp.down_proj.quant_method.name == "compressed-tensors"
    torch.testing.assert_close(run_steps(model), reference_steps(transformers_model(path)), atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # an engine with two spawned ranks per case
@pytest.mark.parametrize("case", ["gptq-act-order", "ct-w4a16-asym", "awq", "ct-fp8-static"])
def test_two_tensor_parallel_ranks_match_one(base, tmp_path, case, reference_4bit_kernels):
    """Shards of packed weights, zeros and groups (act-order rows indexing the global groups on a
    row-parallel rank) and per-part scales of fused layers: greedy tokens of two ranks (and, for AWQ,
    two pipeline stages) are one rank's (and, for the weight-only formats, the float model's)."""
    from engine_helpers import generate_ids, greedy_params, hf_greedy

    from halserve import LLM

    path, dequantized = CASES[case][0](base, str(tmp_path / case))
    prompts = [p * 3 for p in PROMPTS]  # chunked over several steps
    engine = dict(platform="cpu", dtype="float32", max_model_len=64, max_num_batched_tokens=16)
    results = []
    layouts = [dict(), dict(tensor_parallel_size=2)] + ([dict(pipeline_parallel_size=2)] if case == "awq" else [])
    for layout in layouts:
        llm = LLM(path, **layout, **engine)
        try:
            results.append(generate_ids(llm, prompts, greedy_params(6)))
        finally:
            llm.llm_engine.shutdown()
    assert all(r == results[0] for r in results[1:])
    if tolerance(case) == 1e-4:  # weight-only: exact float32 arithmetic
        float_path = str(tmp_path / "float")
        dequantized_hf_model(base, dequantized).save_pretrained(float_path)
        assert results[0] == hf_greedy(float_path, prompts, 6)

"""Quantized checkpoints on the cuda platform's stack without a GPU: the quant methods resolve the
cuda plugin's Triton GEMMs (4-bit GPTQ/AWQ, int8 and fp8 scaled, fp8 block) inside the engine, run
through the Triton interpreter, and greedy output is the CPU reference's.

The interpreter rounds fp32 -> fp8 casts wrongly for a few percent of values, so the activation
quantization ops stay on their torch references (``HALSERVE_KERNELS``) while the GEMMs are Triton.
"""
from __future__ import annotations

import random

import pytest
import torch
from test_triton_engine_interpreted import _interpret_on_cpu

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="a GPU is present: the compiled kernels are tested there instead"
)
pytestmark = [pytestmark, pytest.mark.slow, pytest.mark.extended]  # whole engines through the Triton interpreter, minutes (inner loop: -m 'not slow')

TORCH_QUANT_OPS = "scaled_fp8_quant=torch,per_token_group_fp8_quant=torch"
CASES = {
    # name: (checkpoint builder, the GEMM kernel the layers must resolve)
    "gptq-act-order": (lambda qf, b, o: qf.make_gptq_checkpoint(b, o, desc_act=True), "triton_cuda"),
    "awq": (lambda qf, b, o: qf.make_awq_checkpoint(b, o), "triton_cuda"),
    "ct-w8a8-int8": (lambda qf, b, o: qf.make_ct_checkpoint(b, o, "W8A8"), "triton_cuda"),
    "ct-fp8-dynamic": (lambda qf, b, o: qf.make_ct_checkpoint(b, o, "FP8_DYNAMIC"), "triton_cuda"),
    "fp8-block": (lambda qf, b, o: qf.make_fp8_checkpoint(b, o, block_size=(32, 32)), "triton_cuda"),
}


@pytest.fixture
def interpreted_cuda(monkeypatch):
    from halserve.platforms.cuda import CudaPlatform

    _interpret_on_cpu(monkeypatch, CudaPlatform, capability=lambda self, index=0: (9, 0))


def _greedy(path, prompts, **kwargs):
    from engine_helpers import generate_ids, greedy_params

    from halserve import LLM

    llm = LLM(path, dtype="float32", max_num_batched_tokens=32, max_model_len=128, **kwargs)
    try:
        return generate_ids(llm, prompts, greedy_params(6)), llm.llm_engine.core.executor.worker.model_runner.model
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_checkpoint_on_the_interpreted_cuda_stack(case, interpreted_cuda, tmp_path, monkeypatch):
    import quant_factory as qf
    from model_factory import make_checkpoint

    base = make_checkpoint(str(tmp_path / "base"), "llama", hidden_size=128, num_heads=4, num_kv_heads=2,
                           head_dim=64, intermediate_size=256)
    build, kernel = CASES[case]
    path, _ = build(qf, base, str(tmp_path / case))
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 40)]
    monkeypatch.setenv("HALSERVE_KERNELS", "gptq_gemm=torch,awq_gemm=torch")  # the CPU reference: exact
    expected, _ = _greedy(path, prompts, platform="cpu")
    monkeypatch.setenv("HALSERVE_KERNELS", TORCH_QUANT_OPS)
    got, model = _greedy(path, prompts, platform="cuda", attention_backend="triton_paged")
    layer = model.model.layers[0].mlp.down_proj
    gemm = getattr(layer, "int4_kernel", None) or layer.gemm_kernel
    assert type(gemm).name == kernel
    assert got == expected

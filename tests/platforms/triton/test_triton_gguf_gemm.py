"""The Triton GGUF GEMM (platforms/triton_kernels/gguf.py) against the torch reference (dequantize, then matmul),
for every GGUF type: interpreted on CPU, compiled on a GPU (this directory's conftest).

The activations stay float, so in float32 the kernel is the reference up to summation order (1e-5 of max |ref|),
and an identity input returns the dequantized weight exactly: every decoded value is checked, not only sums.
16-bit models run the dot on 16-bit operands on a GPU (the weight rounded to fp16/bf16): 5e-3 / 2e-2.
A tiny GGUF model served on the interpreted cuda stack resolves the kernel and gives the CPU's greedy tokens."""
from __future__ import annotations

import pytest
import torch

from halserve.kernels.gguf_blocks import GGUF_BLOCKS, dequantize, random_blocks
from halserve.kernels.reference import TorchGgufGemm
from halserve.platforms.triton_kernels.gguf import TritonGgufGemm

QTYPES = list(GGUF_BLOCKS)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _k(qtype: str, blocks: int) -> int:
    return GGUF_BLOCKS[qtype][0] * blocks


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    scale = want.float().abs().max().item()
    err = (got.cpu().float() - want.float()).abs().max().item()
    assert err <= TOLERANCE[dtype] * scale, (err, scale)


@pytest.mark.parametrize("qtype", QTYPES)
def test_identity_input_returns_every_dequantized_value_exactly(qtype, device):
    k = _k(qtype, 2 if GGUF_BLOCKS[qtype][0] == 32 else 1)
    w = random_blocks(qtype, 33, k, torch.Generator().manual_seed(1))
    got = TritonGgufGemm()(torch.eye(k, device=device), w.to(device), qtype)  # [K, N] = W.T
    torch.testing.assert_close(got.cpu(), dequantize(w, qtype, k).t(), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("qtype", QTYPES)
def test_matches_the_torch_reference(qtype, dtype, device):
    # M not a multiple of the tile, N over two tiles, K of 3 blocks (2 super-blocks), a bias
    g = torch.Generator().manual_seed(GGUF_BLOCKS[qtype][1])
    k = _k(qtype, 3 if GGUF_BLOCKS[qtype][0] == 32 else 2)
    w = random_blocks(qtype, 40, k, g)
    x = torch.randn(5, k, generator=g).to(dtype)
    bias = (0.1 * torch.randn(40, generator=g)).to(dtype)
    got = TritonGgufGemm()(x.to(device), w.to(device), qtype, bias.to(device))
    _check(got, TorchGgufGemm()(x, w, qtype, bias), dtype)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q5_K"])
def test_gpu_tiles_mask_the_k_tail_and_keep_leading_dims(qtype, device):
    # the GPU's 64-deep K steps over K = 96 (one and a half steps) or 768 (three super-blocks); x [2, 3, K]
    from halserve.platforms.triton_kernels.jit.gguf_gemm import gguf_gemm

    g = torch.Generator().manual_seed(7)
    k = 96 if GGUF_BLOCKS[qtype][0] == 32 else 768
    w = random_blocks(qtype, 70, k, g)
    x = torch.randn(2, 3, k, generator=g)
    got = gguf_gemm(x.to(device), w.to(device), qtype, tiles={"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64})
    assert got.shape == (2, 3, 70)
    _check(got, TorchGgufGemm()(x, w, qtype), torch.float32)
    assert gguf_gemm(x[:0].to(device), w.to(device), qtype).shape == (0, 3, 70)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", QTYPES)
def test_bfloat16_matches_the_torch_reference(qtype, device):
    # (the interpreter mis-computes bf16 arithmetic: GPU only)
    g = torch.Generator().manual_seed(3)
    k = _k(qtype, 4 if GGUF_BLOCKS[qtype][0] == 32 else 2)
    w = random_blocks(qtype, 96, k, g)
    x = torch.randn(37, k, generator=g).to(torch.bfloat16)
    _check(TritonGgufGemm()(x.to(device), w.to(device), qtype), TorchGgufGemm()(x, w, qtype), torch.bfloat16)


def test_declines_with_reasons_and_rejects_a_wrong_weight():
    assert TritonGgufGemm.supports(dtype="float16", n=8, k=512, qtype="Q6_K") is None
    assert "not a whole number of Q4_K blocks" in TritonGgufGemm.supports(dtype="float32", n=8, k=96, qtype="Q4_K")
    assert "Q5_0 is not one of" in TritonGgufGemm.supports(dtype="float32", n=8, k=64, qtype="Q5_0")
    assert "int8" in TritonGgufGemm.supports(dtype="int8", n=8, k=64, qtype="Q8_0")
    with pytest.raises(ValueError, match=r"uint8 \[N, 36\]"):
        TritonGgufGemm()(torch.zeros(1, 64), torch.zeros(4, 34, dtype=torch.uint8), "Q4_0")


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_the_gguf_method_resolves_to_the_triton_kernel(platform):
    from halserve.kernels import resolve_kernel

    kernel = resolve_kernel("gguf_gemm", platform, dtype="bfloat16", n=576, k=1536, qtype="Q4_K")
    assert isinstance(kernel, TritonGgufGemm) and kernel.name == f"triton_{platform}"


@pytest.mark.slow
@pytest.mark.extended  # a whole engine through the Triton interpreter (7 s): CI's extended step, as its siblings
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the compiled kernel is tested there instead")
def test_a_gguf_model_on_the_interpreted_cuda_stack(tmp_path, monkeypatch):
    # a tiny Q4_1 GGUF (tests/models/test_gguf_loading.py's writer): the gguf method's layers and LM head resolve
    # the Triton kernel on cuda, and greedy output is the CPU's with the float reference kernel
    import importlib.util
    import os

    from test_triton_engine_interpreted import _interpret_on_cpu

    from halserve.platforms.cuda import CudaPlatform

    gguf = pytest.importorskip("gguf", reason="the GGUF tests need the gguf package (pip install 'halserve[gguf]')")
    spec = importlib.util.spec_from_file_location(
        "gguf_loading_helpers", os.path.join(os.path.dirname(__file__), "..", "..", "models", "test_gguf_loading.py"))
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    path = helpers.write_gguf(str(tmp_path / "q41.gguf"), "llama", qtype=gguf.GGMLQuantizationType.Q4_1)
    batch = helpers.prompts(2)
    monkeypatch.setenv("HALSERVE_KERNELS", "gguf_gemm=torch")
    expected = helpers.halserve_greedy(path, batch, max_new_tokens=4, quantization="gguf")
    monkeypatch.delenv("HALSERVE_KERNELS")
    _interpret_on_cpu(monkeypatch, CudaPlatform, capability=lambda self, index=0: (9, 0))
    from halserve import LLM, SamplingParams

    llm = LLM(path, platform="cuda", dtype="float32", max_model_len=128, block_size=16, num_kv_blocks=64,
              max_num_batched_tokens=32, attention_backend="torch")  # (a small budget: a small profiling run)
    try:
        model = llm.llm_engine.core.executor.worker.model_runner.model
        assert type(model.model.layers[0].mlp.down_proj.gguf_runs[0][0]).name == "triton_cuda"
        assert type(model.lm_head.gemm).name == "triton_cuda"
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    finally:
        llm.llm_engine.shutdown()

"""The cuda and rocm plugins register their backends and kernels, describable without a GPU or triton import."""
import subprocess
import sys

from halserve.attention_backends.flash_attn import FlashAttnBackend
from halserve.attention_backends.triton_paged import RocmTritonPagedAttentionBackend, TritonPagedAttentionBackend
from halserve.platforms import cuda, rocm


def test_cuda_plugin_contributes():
    backends = cuda.halserve_attention_backends()
    assert backends == [FlashAttnBackend, TritonPagedAttentionBackend]
    kernels = {(k.op, k.name): k for k in cuda.halserve_kernels()}
    assert ("fp8_scaled_gemm", "cuda_scaled_mm") in kernels
    for op in ["fp8_scaled_gemm", "int8_scaled_gemm", "scaled_fp8_quant", "scaled_int8_quant", "awq_gemm",
               "gptq_gemm", "gguf_gemm", "rms_norm", "rotary_embedding", "silu_and_mul", "gelu_tanh_and_mul",
               "fused_moe"]:
        k = kernels[(op, "triton_cuda")]
        assert k.platforms == ("cuda",) and k.runs_on("cuda") and not k.runs_on("rocm")
    assert kernels[("fp8_scaled_gemm", "triton_cuda")].dtypes == ("float8_e4m3fn", "float8_e5m2")


def test_rocm_plugin_contributes_its_own_names():
    assert rocm.halserve_attention_backends() == [RocmTritonPagedAttentionBackend]
    assert rocm.RocmPlatform.preferred_attention_backends[0] == "triton_paged_rocm"
    kernels = rocm.halserve_kernels()
    assert {k.name for k in kernels} == {"triton_rocm"}
    fp8 = next(k for k in kernels if k.op == "fp8_scaled_gemm")
    assert fp8.dtypes[0] == "float8_e4m3fnuz" and fp8.platforms == ("rocm",)
    assert fp8.supports(dtype="float8_e4m3fnuz", n=64, k=64, fp8_dtype="float8_e4m3fnuz") is None


def test_describe_lists_configurations():
    d = TritonPagedAttentionBackend.describe()
    assert d["head_sizes"] == [64, 80, 96, 128, 256] and d["block_sizes"] == [16, 32, 64]
    assert "fp8" in d["kv_cache_dtypes"] and d["sliding_window"] and d["logits_soft_cap"]
    wo4 = next(k for k in cuda.halserve_kernels() if k.op == "awq_gemm").describe()
    assert wo4["group_sizes"] == [32, 64, 128, -1]


def test_supports_reasons():
    assert "block size 16" in FlashAttnBackend.supports(dtype="float16", head_size=128, block_size=16)
    assert "float32" in FlashAttnBackend.supports(dtype="float32", head_size=128, block_size=256)
    reason = FlashAttnBackend.supports(dtype="float16", head_size=128, block_size=256)
    assert reason is None or "flash_attn" in reason  # "flash_attn is not installed" here
    assert TritonPagedAttentionBackend.supports(dtype="bfloat16", head_size=80, block_size=32,
                                                kv_cache_dtype="fp8", sliding_window=4096,
                                                logits_soft_cap=30.0) is None
    assert "head size 72" in TritonPagedAttentionBackend.supports(dtype="float16", head_size=72, block_size=16)


def test_listing_imports_no_vendor_library():
    code = (
        "import sys, halserve.platforms.cuda as c, halserve.platforms.rocm as r\n"
        "[k.describe() for k in c.halserve_kernels() + r.halserve_kernels()]\n"
        "[b.describe() for b in c.halserve_attention_backends() + r.halserve_attention_backends()]\n"
        "assert 'triton' not in sys.modules and 'flash_attn' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

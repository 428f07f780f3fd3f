"""A halserve plugin with planted bugs, for the conformance kit's own tests.

- platform ``broken`` (CPU device, gloo), preferring its own backend ``broken_attn``;
- ``broken_attn``: the torch reference backend with an off-by-one causal mask in
  prefills (each query also sees the next position);
- ``gemm/broken_gemm``: returns 1.01 x the right result;
- ``fp8_scaled_gemm/broken_fp8``: ignores ``scale_b``.
"""
from __future__ import annotations

from halserve.attention_backends.torch_ref import TorchAttentionBackend
from halserve.kernels.base import Kernel
from halserve.platforms.base import Platform, ProbeResult
from halserve.plugins import PluginManifest, hookimpl


class BrokenPlatform(Platform):
    name = "broken"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = -20  # never auto-selected
    supported_dtypes = ("float32", "float16")
    default_dtype = "float32"
    preferred_attention_backends = ("broken_attn", "torch")
    description = "test fixture: a CPU platform whose backend and kernels are wrong on purpose"

    @classmethod
    def _probe(cls) -> ProbeResult:
        return ProbeResult(True, "the broken platform runs on the CPU")


class BrokenAttentionBackend(TorchAttentionBackend):
    name = "broken_attn"
    platforms = ("broken", "cpu")
    description = "torch reference with an off-by-one causal mask"

    def _prefill_inputs(self, meta, span, block_size, device):
        import torch

        block_ids, _mask = super()._prefill_inputs(meta, span, block_size, device)
        q_pos = torch.arange(span.context_len, span.seq_len, device=device).unsqueeze(1)
        k_pos = torch.arange(span.seq_len, device=device).unsqueeze(0)
        return block_ids, k_pos <= q_pos + 1  # BUG: sees one future token


class BrokenGemm(Kernel):
    op = "gemm"
    name = "broken_gemm"
    platforms = ("broken",)
    priority = 100
    dtypes = ("float32", "float16")

    def __call__(self, x, weight, bias=None):
        import torch.nn.functional as F

        return F.linear(x, weight, bias) * 1.01  # BUG: wrong scale


class BrokenFp8Gemm(Kernel):
    op = "fp8_scaled_gemm"
    name = "broken_fp8"
    platforms = ("broken",)
    priority = 100
    dtypes = ("float8_e4m3fn",)

    def __call__(self, a, b, scale_a, scale_b, out_dtype, bias=None):
        m = a.shape[0]
        sa = scale_a.float().reshape(-1, 1).expand(m, 1)
        out = (a.float() * sa) @ b.float().T  # BUG: scale_b ignored
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)


@hookimpl
def halserve_manifest() -> PluginManifest:
    return PluginManifest(name="broken", version="0.0.1", api=">=1,<2", description="planted bugs for the kit's tests")


@hookimpl
def halserve_platforms() -> list[type]:
    return [BrokenPlatform]


@hookimpl
def halserve_attention_backends() -> list[type]:
    return [BrokenAttentionBackend]


@hookimpl
def halserve_kernels() -> list[type]:
    return [BrokenGemm, BrokenFp8Gemm]

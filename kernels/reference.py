"""Plain-torch reference kernels: the definition of correct for every op in ``OPS``.

Registered by the ``builtin`` plugin for every platform at priority 0, so every op
resolves somewhere; faster kernels register at higher priority.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from halserve.kernels.base import ANY_PLATFORM, Kernel

_FLOATS = ("float32", "float16", "bfloat16")


class TorchGemm(Kernel):
    op = "gemm"
    name = "torch"
    platforms = (ANY_PLATFORM,)
    dtypes = _FLOATS
    description = "torch.nn.functional.linear (the vendor BLAS of the device)"

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)


def _dequant_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    # [1] or [rows] or [rows, 1] -> [rows, 1]
    return scale.reshape(-1, 1).to(torch.float32).expand(rows, 1) if scale.numel() == 1 else scale.reshape(rows, 1).float()


class TorchFp8ScaledGemm(Kernel):
    op = "fp8_scaled_gemm"
    name = "torch"
    platforms = (ANY_PLATFORM,)
    dtypes = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2")
    description = "dequantize to fp32 and matmul (reference)"

    def __call__(self, a, b, scale_a, scale_b, out_dtype, bias=None):
        m, n = a.shape[0], b.shape[0]
        out = (a.float() * _dequant_scales(scale_a, m)) @ (b.float() * _dequant_scales(scale_b, n)).T
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)


class TorchInt8ScaledGemm(Kernel):
    op = "int8_scaled_gemm"
    name = "torch"
    platforms = (ANY_PLATFORM,)
    dtypes = ("int8",)
    description = "exact int32 accumulation, then scales (reference)"

    def __call__(self, a, b, scale_a, scale_b, out_dtype, bias=None):
        m, n = a.shape[0], b.shape[0]
        # int64 matmul is exact for int8 products; CPU torch has no int32 GEMM in every build.
        acc = (a.to(torch.int64) @ b.to(torch.int64).T).to(torch.float32)
        out = acc * _dequant_scales(scale_a, m) * _dequant_scales(scale_b, n).T
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)


class TorchScaledFp8Quant(Kernel):
    op = "scaled_fp8_quant"
    name = "torch"
    platforms = (ANY_PLATFORM,)
    dtypes = _FLOATS

    def __call__(self, x, fp8_dtype, scale=None, per_token=False):
        fp8 = getattr(torch, fp8_dtype) if isinstance(fp8_dtype, str) else fp8_dtype
        fmax = torch.finfo(fp8).max
        xf = x.float()
        if scale is None:
            amax = xf.abs().amax(dim=-1, keepdim=True) if per_token else xf.abs().amax().reshape(1)
            scale = (amax / fmax).clamp(min=1e-12)
        q = (xf / scale.reshape(-1, 1) if scale.numel() > 1 else xf / scale).clamp(-fmax, fmax).to(fp8)
        return q, scale.float()


class TorchScaledInt8Quant(Kernel):
    op = "scaled_int8_quant"
    name = "torch"
    platforms = (ANY_PLATFORM,)
    dtypes = _FLOATS

    def __call__(self, x, scale=None):
        xf = x.float()
        if scale is None:
            scale = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-12)
        q = torch.round(xf / scale).clamp(-128, 127).to(torch.int8)
        return q, scale.float()


def check_block_scaled_operands(a, b, scale_a, scale_b, block_size) -> tuple[int, int]:
    """Validate the operands of ``fp8_block_scaled_gemm``; returns ``(Bn, Bk)``. Shared by its kernels."""
    if len(block_size) != 2 or min(block_size) < 1:
        raise ValueError(f"block_size must be (Bn, Bk) of positive ints (e.g. (128, 128)), got {block_size!r}")
    block_n, block_k = (int(v) for v in block_size)
    (m, k), n = a.shape, b.shape[0]
    if b.shape[1] != k:
        raise ValueError(f"a is [{m}, {k}] but b is {list(b.shape)}; b must be [N, K]")
    if a.dtype != b.dtype:
        raise ValueError(f"a is {a.dtype} but b is {b.dtype}; quantize both to the same fp8 dtype")
    k_blocks = -(-k // block_k)
    if tuple(scale_a.shape) != (m, k_blocks):
        raise ValueError(f"scale_a is {list(scale_a.shape)}, expected [M, ceil(K/{block_k})] = [{m}, {k_blocks}]")
    if tuple(scale_b.shape) != (-(-n // block_n), k_blocks):
        raise ValueError(f"scale_b is {list(scale_b.shape)}, expected [ceil(N/{block_n}), ceil(K/{block_k})] = "
                         f"[{-(-n // block_n)}, {k_blocks}]")
    return block_n, block_k


class TorchFp8BlockScaledGemm(Kernel):
    op = "fp8_block_scaled_gemm"
    name = "torch"
    platforms = (ANY_PLATFORM,)
    dtypes = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2")
    description = "expand the block scales, dequantize to fp32 and matmul (reference)"

    def __call__(self, a, b, scale_a, scale_b, block_size, out_dtype, bias=None):
        block_n, block_k = check_block_scaled_operands(a, b, scale_a, scale_b, block_size)
        (_, k), n = a.shape, b.shape[0]
        # one scale per element: repeat each block's scale over its rows/columns, cut the tails
        sa = scale_a.float().repeat_interleave(block_k, dim=1)[:, :k]  # [M, K]
        sb = scale_b.float().repeat_interleave(block_n, dim=0).repeat_interleave(block_k, dim=1)[:n, :k]  # [N, K]
        out = (a.float() * sa) @ (b.float() * sb).T
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)


class TorchPerTokenGroupFp8Quant(Kernel):
    op = "per_token_group_fp8_quant"
    name = "torch"
    platforms = (ANY_PLATFORM,)
    dtypes = _FLOATS

    def __call__(self, x, fp8_dtype, group_size):
        if group_size < 1:
            raise ValueError(f"group_size must be a positive int (128 for DeepSeek-V3-style fp8), got {group_size}")
        fp8 = getattr(torch, fp8_dtype) if isinstance(fp8_dtype, str) else fp8_dtype
        fmax = torch.finfo(fp8).max
        m, k = x.shape
        num_groups = -(-k // group_size)
        # zero-pad K to whole groups (zeros leave every amax unchanged): [M, groups, G]
        xf = F.pad(x.float(), (0, num_groups * group_size - k)).reshape(m, num_groups, group_size)
        scale = (xf.abs().amax(dim=-1) / fmax).clamp(min=1e-12)  # [M, groups]
        q = (xf / scale[..., None]).clamp(-fmax, fmax).reshape(m, -1)[:, :k].to(fp8)
        return q, scale


class TorchRmsNorm(Kernel):
    op = "rms_norm"
    name = "torch"
    platforms = (ANY_PLATFORM,)
    dtypes = _FLOATS

    def __call__(self, x, weight, eps, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            # One fused pass; bitwise equal to the spelled-out formula below in fp32.
            out = F.rms_norm(x, (x.shape[-1],), weight, eps)
        else:
            # As transformers: normalise in fp32, cast back, then scale by the weight.
            xf = x.float()
            out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
        return out if residual is None else (out, residual)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """Rotate x[..., R] with cos/sin[..., R/2] (neox: halves; gpt-j: interleaved pairs)."""
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


class TorchRotaryEmbedding(Kernel):
    op = "rotary_embedding"
    name = "torch"
    platforms = (ANY_PLATFORM,)
    dtypes = _FLOATS

    def __call__(self, positions, q, k, cos_sin_cache, head_size, is_neox):
        num_tokens = positions.shape[0]
        cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [T, R/2] each
        rot = cos.shape[-1] * 2
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads

        def apply(t: torch.Tensor) -> torch.Tensor:
            t = t.view(num_tokens, -1, head_size)
            rotated = rotate(t[..., :rot].float(), cos.float(), sin.float(), is_neox).to(t.dtype)
            if rot < head_size:
                rotated = torch.cat((rotated, t[..., rot:]), dim=-1)
            return rotated.reshape(num_tokens, -1)

        return apply(q), apply(k)


class TorchSiluAndMul(Kernel):
    op = "silu_and_mul"
    name = "torch"
    platforms = (ANY_PLATFORM,)
    dtypes = _FLOATS

    def __call__(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)


class TorchGeluTanhAndMul(Kernel):
    op = "gelu_tanh_and_mul"
    name = "torch"
    platforms = (ANY_PLATFORM,)
    dtypes = _FLOATS

    def __call__(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)


class TorchAwqGemm(Kernel):
    op = "awq_gemm"
    name = "torch"
    platforms = (ANY_PLATFORM,)
    dtypes = _FLOATS
    description = "unpack AutoAWQ nibbles, dequantize, matmul (reference)"

    def __call__(self, x, qweight, qzeros, scales, group_size):
        from halserve.kernels.packing import dequantize_awq

        w = dequantize_awq(qweight, qzeros, scales, group_size)  # [K, N] fp32
        return (x.float() @ w).to(x.dtype)


class TorchGptqGemm(Kernel):
    op = "gptq_gemm"
    name = "torch"
    platforms = (ANY_PLATFORM,)
    dtypes = _FLOATS
    description = "unpack GPTQ v1 nibbles (zero + 1, g_idx), dequantize, matmul (reference)"

    def __call__(self, x, qweight, qzeros, scales, g_idx, group_size):
        from halserve.kernels.packing import dequantize_gptq

        w = dequantize_gptq(qweight, qzeros, scales, g_idx, group_size)  # [K, N] fp32
        return (x.float() @ w).to(x.dtype)


class TorchGgufGemm(Kernel):
    op = "gguf_gemm"
    name = "torch"
    platforms = (ANY_PLATFORM,)
    dtypes = _FLOATS
    description = "dequantize the GGUF blocks to float32 and matmul (reference)"

    @classmethod
    def _supports(cls, **problem) -> str | None:
        from halserve.kernels.gguf_blocks import GGUF_BLOCKS

        qtype = problem.get("qtype")
        if qtype is not None and qtype not in GGUF_BLOCKS:
            return f"GGUF type {qtype} is not one of {', '.join(GGUF_BLOCKS)}"
        return None

    def __call__(self, x, qweight, qtype, bias=None):
        from halserve.kernels.gguf_blocks import dequantize

        w = dequantize(qweight, qtype, x.shape[-1])  # [N, K] fp32
        return F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)


class TorchFusedMoe(Kernel):
    op = "fused_moe"
    name = "torch"
    platforms = (ANY_PLATFORM,)
    dtypes = _FLOATS
    description = "tokens grouped by expert, one SwiGLU per expert that got tokens, index_add_ (reference)"

    def __call__(self, hidden, w13, w2, topk_weights, topk_ids):
        num_tokens, top_k = topk_ids.shape
        num_experts = w13.shape[0]
        # Sort the T*k (token, slot) pairs by expert so each expert sees one contiguous run of rows.
        flat_ids = topk_ids.reshape(-1)
        expert_ids, order = torch.sort(flat_ids, stable=True)
        token_ids = order // top_k  # [T*k] the token of each sorted pair
        weights = topk_weights.reshape(-1)[order].float()
        counts = torch.bincount(expert_ids, minlength=num_experts).tolist()  # one host sync per call
        out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = token_ids[start : start + count]
            x = hidden.index_select(0, rows)  # [n, H]
            gate, up = F.linear(x, w13[expert]).chunk(2, dim=-1)  # [n, I] each
            y = F.linear(F.silu(gate) * up, w2[expert])  # [n, H]
            out.index_add_(0, rows, y.float() * weights[start : start + count, None])
            start += count
        return out.to(hidden.dtype)


REFERENCE_KERNELS: list[type[Kernel]] = [
    TorchGemm,
    TorchFp8ScaledGemm,
    TorchInt8ScaledGemm,
    TorchScaledFp8Quant,
    TorchScaledInt8Quant,
    TorchAwqGemm,
    TorchGptqGemm,
    TorchGgufGemm,
    TorchRmsNorm,
    TorchRotaryEmbedding,
    TorchSiluAndMul,
    TorchFusedMoe,
    TorchGeluTanhAndMul,
    TorchPerTokenGroupFp8Quant,
    TorchFp8BlockScaledGemm,
]

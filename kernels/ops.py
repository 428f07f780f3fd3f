"""The ops halserve's layers call, with their exact signatures.

Every op has a plain-torch reference in ``reference.py``: the definition of correct that
every other kernel is tested against. Shapes use M tokens, K input features, N output
features, T tokens, H hidden size, G group size.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class OpSpec:
    name: str
    signature: str  # the call, with shapes
    problem_keys: tuple[str, ...]  # keys of supports(**problem) besides dtype


OPS: dict[str, OpSpec] = {
    spec.name: spec
    for spec in [
        OpSpec(
            "gemm",
            "gemm(x[M,K], weight[N,K], bias[N] | None) -> [M,N]   (x @ weight.T + bias)",
            ("n", "k"),
        ),
        OpSpec(
            "fp8_scaled_gemm",
            "fp8_scaled_gemm(a[M,K] fp8, b[N,K] fp8, scale_a[M,1]|[1] f32, scale_b[N,1]|[1] f32, "
            "out_dtype, bias[N] | None) -> [M,N] = (a*scale_a) @ (b*scale_b).T + bias",
            ("n", "k", "fp8_dtype"),
        ),
        OpSpec(
            "int8_scaled_gemm",
            "int8_scaled_gemm(a[M,K] int8, b[N,K] int8, scale_a[M,1]|[1] f32, scale_b[N,1]|[1] f32, "
            "out_dtype, bias[N] | None) -> [M,N]",
            ("n", "k"),
        ),
        OpSpec(
            "scaled_fp8_quant",
            "scaled_fp8_quant(x[M,K], fp8_dtype, scale[1] | None, per_token=False) -> (q[M,K], scale[M,1]|[1]); "
            "dynamic when scale is None",
            ("fp8_dtype",),
        ),
        OpSpec(
            "scaled_int8_quant",
            "scaled_int8_quant(x[M,K], scale[1] | None) -> (q[M,K] int8, scale[M,1]|[1]); symmetric, "
            "dynamic per-token when scale is None",
            (),
        ),
        OpSpec(
            "per_token_group_fp8_quant",
            "per_token_group_fp8_quant(x[M,K], fp8_dtype, group_size G) -> (q[M,K] fp8, scale[M,ceil(K/G)] f32); "
            "dynamic: scale = max(amax of the group / fp8 max, 1e-12), q = clamp(x / scale)",
            ("fp8_dtype", "group_size"),
        ),
        OpSpec(
            "fp8_block_scaled_gemm",
            "fp8_block_scaled_gemm(a[M,K] fp8, b[N,K] fp8, scale_a[M,ceil(K/Bk)] f32, "
            "scale_b[ceil(N/Bn),ceil(K/Bk)] f32, block_size (Bn, Bk), out_dtype, bias[N] | None) -> [M,N] "
            "= (a * scale_a per 1xBk group) @ (b * scale_b per BnxBk block).T + bias",
            ("n", "k", "block_size", "fp8_dtype"),
        ),
        OpSpec(
            "awq_gemm",
            "awq_gemm(x[M,K], qweight[K,N/8] int32, qzeros[K/G,N/8] int32, scales[K/G,N], group_size) -> [M,N] "
            "(AutoAWQ GEMM packing: 8 nibbles per int32 in order 0,2,4,6,1,3,5,7)",
            ("n", "k", "group_size"),
        ),
        OpSpec(
            "gptq_gemm",
            "gptq_gemm(x[M,K], qweight[K/8,N] int32, qzeros[K/G,N/8] int32, scales[K/G,N], g_idx[K] | None, "
            "group_size) -> [M,N] (GPTQ v1 packing: nibbles in order along K; stored zero = zero - 1)",
            ("n", "k", "group_size"),
        ),
        OpSpec(
            "gguf_gemm",
            "gguf_gemm(x[M,K], qweight[N,K/B*S] uint8, qtype, bias[N] | None) -> [M,N] (x @ W.T + bias, W the "
            "GGUF blocks of type qtype (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) dequantized; kernels/gguf_blocks.py). "
            "(optional) kernel.argmax_logits(x, qweight, qtype) -> [M,N] whose every row's first maximum is the "
            "call's, token and value (the LM head's greedy rows; the cpu kernel's: one int8 level, near ties at two)",
            ("n", "k", "qtype"),
        ),
        OpSpec(
            "rms_norm",
            "rms_norm(x[T,H], weight[H], eps, residual[T,H] | None) -> out[T,H], or (out, x + residual) "
            "when residual is given (the fused pre-norm residual add)",
            ("hidden_size",),
        ),
        OpSpec(
            "rotary_embedding",
            "rotary_embedding(positions[T] int64, q[T,Hq*D], k[T,Hk*D], cos_sin_cache[P,R] (cos | sin halves), "
            "head_size D, is_neox) -> (q, k) rotated on the first R dims of each head",
            ("head_size", "rotary_dim", "is_neox"),
        ),
        OpSpec("silu_and_mul", "silu_and_mul(x[T,2I]) -> [T,I] = silu(x[:, :I]) * x[:, I:]", ("intermediate_size",)),
        OpSpec(
            "fused_moe",
            "fused_moe(hidden[T,H], w13[E,2I,H] (gate rows | up rows), w2[E,H,I], topk_weights[T,k] f32, "
            "topk_ids[T,k] int) -> [T,H] = sum over j<k of topk_weights[:, j] * "
            "(silu(x @ gate.T) * (x @ up.T)) @ w2.T of expert topk_ids[:, j]",
            ("num_experts", "top_k", "hidden_size", "intermediate_size"),
        ),
        OpSpec(
            "gelu_tanh_and_mul",
            "gelu_tanh_and_mul(x[T,2I]) -> [T,I] = gelu(x[:, :I], approximate='tanh') * x[:, I:]",
            ("intermediate_size",),
        ),
    ]
}

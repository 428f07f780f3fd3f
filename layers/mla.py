"""Multi-head latent attention's paged-cache layer (DeepSeek-V2/V3): what ``Attention`` is to per-head
K/V, for one compressed latent per position (``halserve.kv_cache.spec.MLASpec``).

The model computes, per token (H heads on this rank, r = kv_lora_rank)::

    q_nope [T, H, dn]   q_pe [T, H, dr] (rotated)      from q_proj, or q_a_proj -> norm -> q_b_proj
    kv_c   [T, r]       k_pe [T, dr]    (rotated)      from kv_a_proj_with_mqa -> (norm on kv_c)

and the cache keeps ``cat(kv_c, k_pe)`` per position. ``kv_b_proj`` [H * (dn + dv), r] expands a
latent into per-head keys and values; its two halves are the absorbed weights::

    W_UK [H, dn, r]: k_nope[h] = W_UK[h] @ kv_c       W_UV [H, dv, r]: v[h] = W_UV[h] @ kv_c

so ``q_nope . k_nope = (W_UK^T q_nope) . kv_c``: a decode attends over the latents directly
(``backend.forward_mla``), and only prefills expand them.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from halserve.forward_context import get_forward_context
from halserve.kv_cache.spec import MLASpec
from halserve.layers.context import ModelContext


class MLAAttention(nn.Module):
    """One layer's MLA over the paged latent cache (TP-local heads; the latent is whole on every rank).

    Attributes the model runner sets (as for ``Attention``): ``kv_cache`` [num_blocks, block_size,
    kv_lora_rank + qk_rope_head_dim], ``k_scale`` (fp8 caches), ``layer_index``, ``kv_cache_group``.
    ``w_uk`` [H, dn, r] and ``w_uv`` [H, dv, r]: set by the model from ``kv_b_proj`` after loading.
    """

    def __init__(self, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 kv_lora_rank: int, scale: float, ctx: ModelContext, prefix: str = "") -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = v_head_dim, kv_lora_rank
        self.head_size = qk_nope_head_dim + qk_rope_head_dim
        self.num_kv_heads = 1  # one latent shared by every head
        self.prefix = prefix
        self.spec = MLASpec(kv_lora_rank, qk_rope_head_dim)
        backend_cls: Any = ctx.attn_backend_cls
        if not hasattr(backend_cls, "forward_mla") or "mla" not in backend_cls.kv_cache_spec_kinds():
            kinds = ", ".join(backend_cls.kv_cache_spec_kinds())
            raise ValueError(f"{prefix}: attention backend {backend_cls.name!r} does not serve the mla "
                             f"KV-cache kind (it serves {kinds}); choose a backend that does, e.g. 'torch'")
        self.backend = backend_cls(num_heads, self.head_size, scale, 1, kv_cache_dtype=ctx.kv_cache_dtype)
        self.kv_cache = torch.empty(0)
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.layer_index = 0
        self.kv_cache_group: int | None = None
        self.w_uk = torch.empty(0)
        self.w_uv = torch.empty(0)

    @property
    def kv_cache_spec(self) -> MLASpec:
        return self.spec

    def set_absorbed_weights(self, kv_b_weight: torch.Tensor) -> None:
        """``kv_b_weight`` [H * (dn + dv), r] (this rank's heads) -> ``w_uk`` [H, dn, r], ``w_uv`` [H, dv, r]."""
        expected = (self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)
        if tuple(kv_b_weight.shape) != expected:
            raise ValueError(f"{self.prefix}: kv_b_proj weight has shape {tuple(kv_b_weight.shape)}, expected "
                             f"{expected} (heads x (qk_nope_head_dim + v_head_dim), kv_lora_rank)")
        per_head = kv_b_weight.detach().view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        self.w_uk = per_head[:, : self.qk_nope_head_dim].contiguous()
        self.w_uv = per_head[:, self.qk_nope_head_dim :].contiguous()

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                k_pe: torch.Tensor) -> torch.Tensor:
        # q_nope [T, H, dn], q_pe [T, H, dr], kv_c [T, r], k_pe [T, dr] -> [T, H * dv]
        num_tokens = q_nope.shape[0]
        metadata = get_forward_context().attn_metadata
        if metadata is None:  # dummy run (profiling / warm-up): no cache, no attention
            return q_nope.new_zeros(num_tokens, self.num_heads * self.v_head_dim)
        if self.kv_cache_group is not None:
            metadata = metadata[self.kv_cache_group]
        if self.kv_cache.numel() == 0:
            raise RuntimeError(f"MLA layer {self.prefix!r} has no kv_cache; the model runner must set it")
        if self.w_uk.numel() == 0:
            raise RuntimeError(f"MLA layer {self.prefix!r} has no absorbed weights; call set_absorbed_weights "
                               "after loading kv_b_proj")
        out = self.backend.forward_mla(q_nope, q_pe, kv_c, k_pe, self.kv_cache, metadata, self.w_uk, self.w_uv,
                                       self.k_scale)
        return out.reshape(num_tokens, self.num_heads * self.v_head_dim)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, qk_nope={self.qk_nope_head_dim}, "
                f"qk_rope={self.qk_rope_head_dim}, v={self.v_head_dim}, backend={type(self.backend).__name__}")

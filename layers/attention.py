"""The attention layer models call: reshapes, picks up the step's metadata from the
forward context and hands the paged-cache work to the selected backend."""
from __future__ import annotations

import torch
from torch import nn

from halserve.forward_context import get_forward_context
from halserve.kv_cache.spec import KVCacheSpec, spec_for_window
from halserve.layers.context import ModelContext


class Attention(nn.Module):
    """One layer's paged attention (TP-local head counts).

    Attributes the model runner sets after building the model:
        kv_cache          this layer's cache tensor, ``backend.kv_cache_shape(...)``
        k_scale, v_scale  per-tensor fp8 KV scales (floats; 1.0 unless the checkpoint has them)
        layer_index       its place among the model's attention layers (a KV connector's layer)
        kv_cache_group    a hybrid model's KV-cache group of this layer: the step's metadata is then
                          one per group and it reads its own; None (one group): the metadata itself
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, ctx: ModelContext,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None, prefix: str = "") -> None:
        super().__init__()
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.sliding_window = sliding_window
        self.prefix = prefix
        kwargs = {"sliding_window": sliding_window, "kv_cache_dtype": ctx.kv_cache_dtype}
        if logits_soft_cap is not None:
            kwargs["logits_soft_cap"] = logits_soft_cap
        self.backend = ctx.attn_backend_cls(num_heads, head_size, scale, num_kv_heads, **kwargs)
        # a plain attribute, not a buffer: the runner owns and sizes it; model.to() leaves it alone
        self.kv_cache = torch.empty(0)
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.layer_index = 0
        self.kv_cache_group: int | None = None

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """What this layer keeps in the KV cache (halserve.kv_cache.spec): its window's positions, or all."""
        return spec_for_window(self.sliding_window)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [T, Hq * D], k/v [T, Hk * D] -> [T, Hq * D]
        num_tokens = q.shape[0]
        context = get_forward_context()
        metadata, connector = context.attn_metadata, context.kv_connector
        if metadata is None:  # dummy run (profiling / warm-up): no cache, no attention
            return torch.zeros_like(q)
        if self.kv_cache_group is not None:
            metadata = metadata[self.kv_cache_group]
        if self.kv_cache.numel() == 0:
            raise RuntimeError(f"attention layer {self.prefix!r} has no kv_cache; the model runner must set it")
        if connector is not None:
            connector.wait_for_layer_load(self.layer_index)
        out = self.backend.forward(
            q.view(num_tokens, self.num_heads, self.head_size),
            k.view(num_tokens, self.num_kv_heads, self.head_size),
            v.view(num_tokens, self.num_kv_heads, self.head_size),
            self.kv_cache,
            metadata,
            self.k_scale,
            self.v_scale,
        )
        if connector is not None:
            connector.save_kv_layer(self.layer_index)
        return out.reshape(num_tokens, self.num_heads * self.head_size)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
                f"sliding_window={self.sliding_window}, backend={type(self.backend).__name__}")

"""flash-attn 2 (Dao-AILab) paged attention on NVIDIA GPUs: ``flash_attn_varlen_func`` with ``block_table``.

flash-attn is optional (it builds from source against the local CUDA toolkit), so it is
imported inside ``forward`` only; when it is missing ``supports`` says so and the cuda
platform falls back to ``triton_paged``. Constraints of the upstream kernel (flash-attn
2.6+, csrc/flash_attn/flash_api.cpp ``mha_varlen_fwd``):

* paged KV needs ``page_block_size % 256 == 0`` ("Paged KV cache block size must be
  divisible by 256"), so this backend only takes block sizes 256 and 512;
* fp16/bf16 only, head sizes up to 256 (multiples of 8), no fp8 KV cache;
* ``causal=True`` aligns the mask to the bottom-right corner, which is exactly "query i of
  a request sits at position seq_len - query_len + i" of the halserve batch layout;
* ``window_size=(w - 1, 0)`` keeps keys ``p - w < j <= p``; ``softcap`` needs 2.6+.
"""
from __future__ import annotations

import importlib.util
from typing import Any

from halserve.attention_backends.base import AttentionBackend


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    platforms = ("cuda",)
    dtypes = ("float16", "bfloat16")
    head_sizes = (64, 80, 96, 128, 160, 192, 224, 256)
    block_sizes = (256, 512)  # upstream flash-attn 2: page_block_size % 256 == 0
    kv_cache_dtypes = ("auto",)
    supports_sliding_window = True
    supports_logits_soft_cap = True
    description = "flash-attn 2 flash_attn_varlen_func over the paged cache (block_table); needs block size 256k"

    @classmethod
    def _supports(cls, **config: Any) -> str | None:
        if importlib.util.find_spec("flash_attn") is None:
            return "flash_attn is not installed (pip install 'halserve[flash-attn]' builds it with a CUDA toolkit)"
        try:
            from importlib.metadata import version

            from packaging.version import Version

            installed = version("flash_attn")
            if Version(installed) < Version("2.6"):
                return f"flash_attn {installed} is older than 2.6 (needed for block_table + softcap)"
        except Exception:  # noqa: BLE001 - metadata missing: let forward fail loudly instead
            pass
        return None

    def forward(self, q, k, v, kv_cache, metadata, k_scale: float = 1.0, v_scale: float = 1.0):
        import torch
        from flash_attn import flash_attn_varlen_func

        num_tokens = metadata.num_actual_tokens
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, num_kv_heads, head_size]
        # write the step's K/V first (flash-attn 2 only reads the paged cache)
        slots = metadata.slot_mapping[:num_tokens]
        key_cache.view(-1, *key_cache.shape[2:])[slots] = k[:num_tokens]
        value_cache.view(-1, *value_cache.shape[2:])[slots] = v[:num_tokens]

        out = torch.zeros_like(q) if q.shape[0] > num_tokens else torch.empty_like(q)
        cu_seqlens_k = torch.zeros(metadata.num_reqs + 1, dtype=torch.int32, device=q.device)
        torch.cumsum(metadata.seq_lens, dim=0, out=cu_seqlens_k[1:])
        window = (self.sliding_window - 1, 0) if self.sliding_window else (-1, -1)
        out[:num_tokens] = flash_attn_varlen_func(
            q[:num_tokens],
            key_cache,
            value_cache,
            cu_seqlens_q=metadata.query_start_loc,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=metadata.max_query_len,
            max_seqlen_k=metadata.max_seq_len,
            softmax_scale=self.scale,
            causal=True,
            window_size=window,
            softcap=self.logits_soft_cap or 0.0,
            block_table=metadata.block_table,
        )
        return out

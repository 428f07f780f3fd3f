"""The CPU platform's default backend: the torch backend with a native decode kernel.

Decodes are most of a serving step's attention, and in plain torch they need every
request's blocks gathered into a contiguous copy first (tens of MB per layer per step).
This backend runs decodes with a C++ kernel (``halserve.platforms.cpu_kernels``) that
reads K/V straight from the paged cache; prefills, the cache write and everything the
kernel does not cover (fp16/bf16, fp8 caches) go through the torch backend it extends,
so both always agree. If the kernel cannot be built here, every step uses the torch path
and a warning says why.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from halserve.attention_backends.torch_ref import TorchAttentionBackend, TorchAttentionMetadata

logger = logging.getLogger(__name__)


class CpuNativeAttentionBackend(TorchAttentionBackend):
    name = "cpu_native"
    platforms = ("cpu",)
    description = "torch prefill + a native C++ paged decode kernel (float32, auto KV dtype); built on first use"

    @classmethod
    def _supports(cls, **config) -> str | None:
        from halserve.platforms.cpu_kernels import toolchain_missing

        return toolchain_missing()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._kernel = None
        if self.fp8_dtype is None:
            from halserve.platforms import cpu_kernels

            self._kernel = cpu_kernels.load()
            if self._kernel is None:
                logger.warning("cpu_native: decoding through the torch path: %s", cpu_kernels.load_error())

    def forward(self, q, k, v, kv_cache, metadata, k_scale: float = 1.0, v_scale: float = 1.0):
        if self._kernel is None or q.dtype != torch.float32 or not metadata.decode_req_indices:
            return super().forward(q, k, v, kv_cache, metadata, k_scale, v_scale)
        # The torch backend writes the cache and runs the prefills; decodes are ours.
        no_decodes = metadata.cache.get("cpu_native_no_decodes")
        if no_decodes is None:
            no_decodes = dataclasses.replace(metadata, decode_req_indices=[], decode_token_indices=[])
            no_decodes.cache = metadata.cache
            metadata.cache["cpu_native_no_decodes"] = no_decodes
        out = super().forward(q, k, v, kv_cache, no_decodes, k_scale, v_scale)
        token_idx, block_table, seq_lens = self._decode_rows(metadata)
        q_dec = q.index_select(0, token_idx)  # [Nd, Hq, D]
        o = self._kernel.paged_decode(
            q_dec, kv_cache[0], kv_cache[1], block_table, seq_lens, self.scale,
            self.sliding_window or 0, self.logits_soft_cap or 0.0,
        )
        out.index_copy_(0, token_idx, o)
        return out

    @staticmethod
    def _decode_rows(meta: TorchAttentionMetadata):
        """(token index [Nd], block table rows [Nd, nb] int32, seq_lens [Nd] int32), once per step."""
        hit = meta.cache.get("cpu_native_rows")
        if hit is None:
            rows = torch.tensor(meta.decode_req_indices, dtype=torch.long)
            token_idx = torch.tensor(meta.decode_token_indices, dtype=torch.long)
            block_table = meta.block_table.index_select(0, rows).contiguous()
            seq_lens = meta.seq_lens.index_select(0, rows).contiguous()
            hit = (token_idx, block_table, seq_lens)
            meta.cache["cpu_native_rows"] = hit
        return hit

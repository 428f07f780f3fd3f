"""The CPU platform's default backend: native C++ paged attention over a cache layout
made for it (``platforms/cpu_kernels``; float32, or bfloat16 q/cache/output with float32
arithmetic inside the kernels).

Cache layout (per layer): ``[2, num_blocks, num_kv_heads, block_size * head_size]``::

    keys   [blk, h] viewed as [head_size, block_size]   (transposed: tokens innermost)
    values [blk, h] viewed as [block_size, head_size]   (a row per token)

With keys transposed, 16 keys are scored with one vector load per head dimension and no
horizontal sums. Per layer: ``write_kv`` stores the step's K/V; decodes go through
``paged_decode`` (one task per request and kv head, vectorised softmax; a decode-only
step returns its output directly); prefills and chunks after cached context go through
``paged_prefill`` (flash-style tiles of query positions x the heads sharing a kv head,
online softmax, all spans in one call). Configurations the prefill kernel does not take
(block size or head size not a multiple of 16, more than 8 query heads per kv head) use
SDPA per prompt, like the torch backend whose masks and metadata this backend reuses.
float16 and fp8 caches use the torch backend (the platform's next preference). In bfloat16
the cache holds bf16 (half the bytes a decode step streams: W1's decode attention measured
0.70 ms per layer against 1.98 in float32). The kernels are compiled on first use.
"""
from __future__ import annotations

import torch

from halserve.attention_backends.torch_ref import TorchAttentionBackend, TorchAttentionMetadata


class CpuNativeAttentionBackend(TorchAttentionBackend):
    name = "cpu_native"
    platforms = ("cpu",)
    dtypes = ("float32", "bfloat16")
    kv_cache_dtypes = ("auto",)
    description = ("native C++ paged decode and prefill (transposed-key cache layout); float32 and bfloat16; "
                   "built on first use")

    @classmethod
    def _supports(cls, **config) -> str | None:
        from halserve.platforms.cpu_kernels import toolchain_missing

        return toolchain_missing()

    @classmethod
    def kv_cache_spec_kinds(cls) -> tuple[str, ...]:
        # not MLA: its latent pages have no native kernel here (the inherited forward_mla is the torch
        # backend's, which an MLA model then selects by name)
        return ("full_attention", "sliding_window")

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, num_kv_heads, block_size * head_size)

    @classmethod
    def kv_cache_block_views(cls, kv_cache, block_size: int, num_kv_heads: int, head_size: int):
        keys = kv_cache[0].unflatten(2, (head_size, block_size)).permute(0, 3, 1, 2)  # (transposed)
        values = kv_cache[1].unflatten(2, (block_size, head_size)).transpose(1, 2)
        return keys, values

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from halserve.platforms import cpu_kernels

        self._kernel = cpu_kernels.load()
        self._prefill_ok: dict[int, bool] = {}
        if self._kernel is None:
            raise RuntimeError(
                f"the cpu_native attention backend could not build its kernel: {cpu_kernels.load_error()}; "
                "use attention_backend='torch' (or HALSERVE_ATTENTION_BACKEND=torch)"
            )

    def _views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        num_blocks = kv_cache.shape[1]
        block_size = kv_cache.shape[3] // self.head_size
        keys = kv_cache[0].view(num_blocks, self.num_kv_heads, self.head_size, block_size)
        values = kv_cache[1].view(num_blocks, self.num_kv_heads, block_size, self.head_size)
        return keys, values, block_size

    def forward(self, q, k, v, kv_cache, metadata: TorchAttentionMetadata, k_scale: float = 1.0, v_scale: float = 1.0):
        """q [T, Hq, D], k/v [T, Hk, D] -> [T, Hq, D]."""
        if q.dtype not in (torch.float32, torch.bfloat16) or kv_cache.dtype != q.dtype:
            raise ValueError(f"cpu_native runs float32 or bfloat16 with a cache of the same dtype, got q {q.dtype} "
                             f"and cache {kv_cache.dtype}; use the torch attention backend")
        n = metadata.num_actual_tokens
        block_size = kv_cache.shape[3] // self.head_size
        self._kernel.write_kv(kv_cache, k[:n], v[:n], metadata.slot_mapping[:n], block_size)
        decode_args = (block_size, self.scale, self.sliding_window or 0, self.logits_soft_cap or 0.0)
        if not metadata.prefills and q.shape[0] == n and self._all_decodes_in_order(metadata) and q.is_contiguous():
            # The common decode step: the kernel's output is the layer's output.
            return self._kernel.paged_decode(q, kv_cache, metadata.block_table, metadata.seq_lens, *decode_args)

        # Every real token is written below (decode or prefill); only padding needs zeros.
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        out[n:] = 0
        if metadata.decode_req_indices:
            token_idx, block_table, seq_lens = self._decode_rows(metadata)
            o = self._kernel.paged_decode(q.index_select(0, token_idx), kv_cache, block_table, seq_lens, *decode_args)
            out.index_copy_(0, token_idx, o)
        if metadata.prefills and self._native_prefill(block_size):
            spans = self._prefill_spans(metadata)
            self._kernel.paged_prefill(out, q.contiguous(), kv_cache, metadata.block_table, *spans, *decode_args)
            return out
        keys, values, _ = self._views(kv_cache)
        for span in metadata.prefills:
            block_ids, mask = self._prefill_inputs(metadata, span, block_size, q.device)
            if span.context_len == 0:
                # A fresh prompt sees only this step's keys: the same values that
                # were just written, so skip reading them back from the blocks.
                kk = k[span.token_start : span.token_end].transpose(0, 1).unsqueeze(0)
                vv = v[span.token_start : span.token_end].transpose(0, 1).unsqueeze(0)
            else:
                # [nb, Hk, D, B] -> [1, Hk, nb * B, D];  [nb, Hk, B, D] -> [1, Hk, nb * B, D]
                kk = keys.index_select(0, block_ids).permute(1, 0, 3, 2).reshape(self.num_kv_heads, -1, self.head_size)
                vv = values.index_select(0, block_ids).transpose(0, 1).reshape(self.num_kv_heads, -1, self.head_size)
                kk, vv = kk[:, : span.seq_len].unsqueeze(0), vv[:, : span.seq_len].unsqueeze(0)
            q_pre = q[span.token_start : span.token_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
            o = self._attend(q_pre, kk, vv, mask, is_causal=mask is None)
            out[span.token_start : span.token_end] = o.squeeze(0).transpose(0, 1)
        return out

    def _native_prefill(self, block_size: int) -> bool:
        ok = self._prefill_ok.get(block_size)
        if ok is None:
            ok = self._prefill_ok[block_size] = bool(self._kernel.paged_prefill_supported(
                self.num_heads, self.num_kv_heads, self.head_size, block_size))
        return ok

    @staticmethod
    def _prefill_spans(meta: TorchAttentionMetadata) -> tuple[torch.Tensor, ...]:
        """(token_start, query_len, seq_len, block-table row) of every prefill, int64; once per step."""
        hit = meta.cache.get("cpu_native_spans")
        if hit is None:
            rows = [(s.token_start, s.query_len, s.seq_len, s.req_index) for s in meta.prefills]
            hit = tuple(torch.tensor(col, dtype=torch.long) for col in zip(*rows))
            meta.cache["cpu_native_spans"] = hit
        return hit

    @staticmethod
    def _all_decodes_in_order(meta: TorchAttentionMetadata) -> bool:
        """Request r is a decode whose token is token r, for every r (cached per step)."""
        hit = meta.cache.get("cpu_native_in_order")
        if hit is None:
            hit = (
                len(meta.decode_req_indices) == meta.num_reqs
                and meta.decode_req_indices == list(range(meta.num_reqs))
                and meta.decode_token_indices == list(range(meta.num_reqs))
                and meta.block_table.dtype == torch.int32
                and meta.seq_lens.dtype == torch.int32
            )
            meta.cache["cpu_native_in_order"] = hit
        return hit

    @staticmethod
    def _decode_rows(meta: TorchAttentionMetadata):
        """(token index [Nd], block-table rows [Nd, nb] int32, seq_lens [Nd] int32), once per step."""
        hit = meta.cache.get("cpu_native_rows")
        if hit is None:
            rows = torch.tensor(meta.decode_req_indices, dtype=torch.long)
            token_idx = torch.tensor(meta.decode_token_indices, dtype=torch.long)
            block_table = meta.block_table.index_select(0, rows).contiguous()
            seq_lens = meta.seq_lens.index_select(0, rows).contiguous()
            hit = (token_idx, block_table, seq_lens)
            meta.cache["cpu_native_rows"] = hit
        return hit

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
float16 models and fp8 caches use the torch backend (the platform's next preference). In bfloat16
the cache holds bf16 (half the bytes a decode step streams: W1's decode attention measured
0.70 ms per layer against 1.98 in float32); a float32 model may keep a bfloat16 or float16 cache
(``kv_cache_dtype``; float16 is what GGUF checkpoints get by default, as in llama.cpp), widened to
float32 as it is read. The kernels are compiled on first use.

MLA layers (DeepSeek-V2/V3, ``forward_mla``) keep the torch backend's latent pages
``[num_blocks, block_size, r + dr]`` (``halserve.kv_cache.spec.MLASpec``). Decodes take the absorbed
path with the attention native (``mla_decode.cpp``, the ``mla`` kernel library, built on the first MLA
step): ``q_lat = W_UK^T q_nope`` and ``out = W_UV o_lat`` are batched matmuls in torch, the kernel
scores the latent rows in place (float32, bfloat16 or fp8 pages) with an online softmax and returns
``o_lat``. Prefills are the torch backend's naive path (latents expanded through W_UK / W_UV, SDPA).
"""
from __future__ import annotations

from typing import Any

import torch

from halserve.attention_backends.torch_ref import TorchAttentionBackend, TorchAttentionMetadata

_HALF_CACHES = (torch.bfloat16, torch.float16)  # caches the kernels widen under a float32 model


def kernels_take_cache(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the native kernels run q (and k, v, out) of ``q_dtype`` over a cache of ``cache_dtype``: the same
    dtype, or a 16-bit cache under float32 (the C++ ``cache_dtype_ok``)."""
    return cache_dtype == q_dtype or (q_dtype == torch.float32 and cache_dtype in _HALF_CACHES)


class CpuNativeAttentionBackend(TorchAttentionBackend):
    name = "cpu_native"
    platforms = ("cpu",)
    dtypes = ("float32", "bfloat16")
    # the cache in the model's dtype, or a 16-bit one under a float32 model (the kernels widen it: _supports)
    kv_cache_dtypes = ("auto", "float32", "bfloat16", "float16")
    description = ("native C++ paged decode and prefill (transposed-key cache layout); float32 and bfloat16; "
                   "built on first use")

    @classmethod
    def _supports(cls, **config) -> str | None:
        from halserve.platforms.cpu_kernels import toolchain_missing

        dtype, cache = config.get("dtype"), config.get("kv_cache_dtype", "auto")
        if cache not in ("auto", dtype) and dtype != "float32":
            return (f"a {cache} KV cache under a {dtype} model (its kernels take the model's dtype, or a 16-bit "
                    "cache under float32)")
        return toolchain_missing()

    @classmethod
    def kv_cache_spec_kinds(cls) -> tuple[str, ...]:
        return ("full_attention", "sliding_window", "mla")

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
        self._mla_decode: Any = None  # torch.ops.halserve_cpu_mla.mla_decode, loaded by the first MLA step
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
        if q.dtype not in (torch.float32, torch.bfloat16) or not kernels_take_cache(q.dtype, kv_cache.dtype):
            raise ValueError(f"cpu_native runs float32 or bfloat16 with a cache of the same dtype (or a bfloat16 or "
                             f"float16 one under float32), got q {q.dtype} and cache {kv_cache.dtype}; use the torch "
                             "attention backend")
        n = metadata.num_actual_tokens
        block_size = kv_cache.shape[3] // self.head_size
        self._kernel.write_kv(kv_cache, k[:n], v[:n], metadata.slot_mapping[:n], block_size)
        decode_args = (block_size, *self.decode_constants())
        if not metadata.prefills and q.shape[0] == n and self.all_decodes_in_order(metadata) and q.is_contiguous():
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
                kk, vv = kk[:, : span.seq_len].unsqueeze(0).to(q.dtype), vv[:, : span.seq_len].unsqueeze(0).to(q.dtype)
            q_pre = q[span.token_start : span.token_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
            o = self._attend(q_pre, kk, vv, mask, is_causal=mask is None)
            out[span.token_start : span.token_end] = o.squeeze(0).transpose(0, 1)
        return out

    # -- MLA (module docstring) -------------------------------------------------------------
    def forward_mla(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                    kv_cache: torch.Tensor, metadata: TorchAttentionMetadata, w_uk: torch.Tensor, w_uv: torch.Tensor,
                    k_scale: float = 1.0) -> torch.Tensor:
        """q_nope [T, H, dn], q_pe [T, H, dr], kv_c [T, r], k_pe [T, dr], kv_cache [num_blocks, B, r + dr],
        w_uk [H, dn, r], w_uv [H, dv, r] -> [T, H, dv]. Writes the step's latents, then attends."""
        if not isinstance(metadata, TorchAttentionMetadata):
            raise TypeError("CpuNativeAttentionBackend.forward_mla needs the metadata from its build_metadata, got "
                            f"{type(metadata).__name__}")
        n = metadata.num_actual_tokens
        self._write_mla(kv_cache, torch.cat([kv_c[:n], k_pe[:n]], dim=-1), metadata.slot_mapping[:n].long(), k_scale)
        if not metadata.prefills and q_nope.shape[0] == n and self.all_decodes_in_order(metadata):
            # the common decode step: the kernel's rows are the layer's output
            return self._mla_absorbed(q_nope, q_pe, kv_cache, metadata.block_table, metadata.seq_lens, w_uk, w_uv,
                                      k_scale)
        out = q_nope.new_empty(q_nope.shape[0], w_uv.shape[0], w_uv.shape[1])
        out[n:] = 0  # every real token is written below; padding reads zeros
        if metadata.decode_req_indices:
            token_idx, block_table, seq_lens = self._decode_rows(metadata)
            o = self._mla_absorbed(q_nope.index_select(0, token_idx), q_pe.index_select(0, token_idx), kv_cache,
                                   block_table, seq_lens, w_uk, w_uv, k_scale)
            out.index_copy_(0, token_idx, o)
        block_size = kv_cache.shape[1]
        for span in metadata.prefills:  # naive, as the torch backend: the latents expanded into per-head K/V
            block_ids, mask = self._prefill_inputs(metadata, span, block_size, q_nope.device)
            rows = self._read_mla(kv_cache, block_ids, k_scale, q_nope.dtype)[: span.seq_len]  # [S, r + dr]
            tokens = slice(span.token_start, span.token_end)
            out[tokens] = self.mla_expanded_attention(q_nope[tokens], q_pe[tokens], rows, w_uk, w_uv, mask)
        return out

    def _mla_absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                      block_table: torch.Tensor, seq_lens: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                      k_scale: float) -> torch.Tensor:
        """Decodes in order of ``block_table``'s rows: q_nope [Nd, H, dn], q_pe [Nd, H, dr] -> [Nd, H, dv]."""
        if self._mla_decode is None:
            from halserve.platforms import cpu_kernels

            if cpu_kernels.load_library("mla") is None:
                raise RuntimeError(f"the cpu_native backend could not build its MLA kernel: "
                                   f"{cpu_kernels.load_error('mla')}; use attention_backend='torch'")
            self._mla_decode = torch.ops.halserve_cpu_mla.mla_decode
        rank = w_uk.shape[2]
        q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)  # [Nd, H, r]
        q_full = torch.cat([q_lat, q_pe], dim=-1).float()  # [Nd, H, r + dr]: the kernel computes in float32
        o_lat = self._mla_decode(q_full, kv_cache, block_table, seq_lens, rank, self.scale, k_scale)  # [Nd, H, r]
        return torch.einsum("thr,hvr->thv", o_lat.to(q_nope.dtype), w_uv)

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

    def plain_decode(self, metadata: TorchAttentionMetadata, num_tokens: int):
        """For a caller that runs a step's layers itself (the cpu flat forward, models/llama_flat.py): None unless
        this step is the one ``forward``'s first branch serves (every request decodes one token, in order, no
        padding); else ``(kernel, slot_mapping, block_table, seq_lens)``: the built kernel module (``write_kv``,
        ``paged_decode``, ``rotary_write_decode``) and the step's arguments for it (the rest are
        ``decode_constants``)."""
        if metadata.prefills or num_tokens != metadata.num_actual_tokens or not self.all_decodes_in_order(metadata):
            return None
        return self._kernel, metadata.slot_mapping, metadata.block_table, metadata.seq_lens

    def decode_constants(self) -> tuple[float, int, float]:
        """What follows the block size in the kernel's ``paged_decode`` arguments: scale, window, soft cap."""
        return self.scale, self.sliding_window or 0, self.logits_soft_cap or 0.0

    @staticmethod
    def all_decodes_in_order(meta: TorchAttentionMetadata) -> bool:
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

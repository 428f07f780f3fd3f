"""Paged attention in plain torch: the correctness oracle and the CPU platform's default.

Per step (``build_metadata``, once, shared by all layers) the batch is split on the host
into decode requests (query_len == 1) and prefill requests (query_len > 1, possibly a
chunk after cached context); requests may come in any order.

Per layer (``forward``):

1. write every scheduled token's K/V into the cache at ``slot_mapping``
   (fp8 caches: ``x / scale`` saturated to the fp8 range);
2. decodes, batched: gather ``ceil(max_decode_seq_len / block_size)`` blocks of every
   decode request in one ``index_select``, mask positions past each ``seq_len`` (and
   outside the sliding window), one ``scaled_dot_product_attention`` call;
3. prefills, one request at a time: gather its blocks, causal mask offset by the cached
   context (``is_causal`` when there is none), one SDPA call.

Both read K/V back from the cache, so new tokens are seen exactly as later steps will
see them (quantized, for fp8 caches). Masks depend only on the step and the sliding
window, so they are built by the first layer that needs them and reused by the rest.
Measured on CPU fp32, one thread, 64 decodes x 256 context x 12/4 heads x 64: SDPA with
``enable_gqa`` beat explicit matmul+softmax about 2x, and gathering into a per-step
workspace instead of fresh tensors took a layer from ~70 ms to ~15 ms (page faults of
multi-MB allocations dominated). The explicit matmul path (~40 ms) is kept for logits
soft-capping, which SDPA cannot do.

MLA layers (DeepSeek-V2/V3, ``forward_mla``; ``halserve.layers.mla``) keep one latent row
``cat(kv_c, k_pe)`` per position in a ``[num_blocks, block_size, r + dr]`` cache. Prefills expand
the gathered latents into per-head keys and values through W_UK / W_UV and run SDPA (the naive
path, as the checkpoint computes it); decodes absorb W_UK into the query and W_UV into the output
and attend over the latent rows themselves (one shared "head" of r + dr values)::

    q_lat  = W_UK^T q_nope                      [Nd, H, r]
    scores = cat(q_lat, q_pe) . cache rows      [Nd, H, L]   (x scale, masked past seq_len)
    o_lat  = softmax(scores) @ kv_c rows        [Nd, H, r]
    out    = W_UV o_lat                         [Nd, H, dv]
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F

from halserve.attention_backends.base import AttentionBackend, AttentionMetadata

_FP8_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


@dataclass(slots=True)
class PrefillSpan:
    """One request with query_len > 1."""

    token_start: int  # its first token in the flattened batch
    token_end: int  # one past its last token
    seq_len: int  # context including this step's tokens
    req_index: int  # row of block_table
    masks: dict[Any, torch.Tensor | None] = field(default_factory=dict)  # (block_size, window) -> [Lq, Lk] bool

    @property
    def query_len(self) -> int:
        return self.token_end - self.token_start

    @property
    def context_len(self) -> int:
        return self.seq_len - self.query_len


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    """The common metadata plus the host-side split into decodes and prefills."""

    decode_req_indices: list[int] = field(default_factory=list)  # rows of block_table, batch order
    decode_token_indices: list[int] = field(default_factory=list)  # their token in the batch
    decode_max_seq_len: int = 0
    prefills: list[PrefillSpan] = field(default_factory=list)
    # device tensors built lazily by the first layer (they need the cache's block size)
    cache: dict[Any, Any] = field(default_factory=dict)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    platforms = ("*",)
    dtypes = ("float32", "float16", "bfloat16")
    kv_cache_dtypes = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
    supports_sliding_window = True
    supports_logits_soft_cap = True
    description = "plain torch (SDPA over gathered blocks); the reference every backend is checked against"

    @classmethod
    def kv_cache_spec_kinds(cls) -> tuple[str, ...]:
        return ("full_attention", "sliding_window", "mla")

    @classmethod
    def build_metadata(cls, common: AttentionMetadata) -> TorchAttentionMetadata:
        starts = common.query_start_loc_cpu.tolist()
        seq_lens = common.seq_lens_cpu.tolist()
        meta = TorchAttentionMetadata(**{f.name: getattr(common, f.name) for f in fields(AttentionMetadata)})
        for r in range(common.num_reqs):
            start, end = starts[r], starts[r + 1]
            query_len = end - start
            if query_len > seq_lens[r]:
                raise ValueError(
                    f"request {r} schedules {query_len} tokens but its seq_len is {seq_lens[r]}; "
                    "seq_lens must include this step's tokens"
                )
            if query_len == 1:
                meta.decode_req_indices.append(r)
                meta.decode_token_indices.append(start)
                meta.decode_max_seq_len = max(meta.decode_max_seq_len, seq_lens[r])
            elif query_len > 1:
                meta.prefills.append(PrefillSpan(start, end, seq_lens[r], r))
        return meta

    def __init__(self, num_heads, head_size, scale, num_kv_heads, sliding_window=None, logits_soft_cap=None,
                 kv_cache_dtype="auto") -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, sliding_window, logits_soft_cap, kv_cache_dtype)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        self.fp8_dtype = _FP8_DTYPES.get(kv_cache_dtype)
        if kv_cache_dtype not in TorchAttentionBackend.kv_cache_dtypes:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported by the torch backend")

    # -- cache I/O ----------------------------------------------------------------------
    def _cache_fp8(self, cache: torch.Tensor) -> torch.dtype:
        """The fp8 flavour actually allocated (a platform may use e4m3fnuz for "fp8")."""
        return cache.dtype if cache.dtype.itemsize == 1 and cache.dtype.is_floating_point else self.fp8_dtype

    def _write(self, cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, scale: float) -> None:
        """cache [num_blocks, block_size, Hk, D]; x [n, Hk, D]; slots [n]."""
        flat = cache.view(-1, self.num_kv_heads, self.head_size)  # [num_slots, Hk, D]
        if self.fp8_dtype is None:
            flat.index_copy_(0, slots, x.to(flat.dtype))
            return
        fp8 = self._cache_fp8(cache)
        fmax = torch.finfo(fp8).max
        q = (x.float() / scale).clamp_(-fmax, fmax).to(fp8)
        # CPU has no index_copy_ for fp8: move the bytes through a uint8 view.
        flat.view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))

    def _read(self, cache: torch.Tensor, block_ids: torch.Tensor, scale: float, dtype: torch.dtype,
              workspace: torch.Tensor) -> torch.Tensor:
        """Gather blocks: cache [num_blocks, B, Hk, D], block_ids [n] -> [n * B, Hk, D].

        Writes into ``workspace`` (reused by every layer of the step): allocating a fresh
        multi-MB tensor per layer costs more in page faults than the copy itself."""
        n = block_ids.shape[0]
        rows = cache.view(cache.shape[0], -1)  # [num_blocks, B * Hk * D]: one memcpy per block
        out_shape = (n * cache.shape[1], self.num_kv_heads, self.head_size)
        if self.fp8_dtype is None:
            out = workspace[: rows.shape[1] * n].view(n, -1)
            if rows.dtype == out.dtype:
                torch.index_select(rows, 0, block_ids, out=out)
            else:  # a 16-bit cache under a float32 model: widened as it is gathered
                out.copy_(torch.index_select(rows, 0, block_ids))
            return out.view(out_shape)
        raw = torch.index_select(rows.view(torch.uint8), 0, block_ids)  # [n, B * Hk * D] fp8 bytes
        out = workspace[: raw.numel()].view(raw.shape)
        out.copy_(raw.view(self._cache_fp8(cache))).mul_(scale)
        return out.view(out_shape)

    @staticmethod
    def _workspace(meta: TorchAttentionMetadata, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A flat scratch buffer of at least ``numel`` elements, kept for the whole step."""
        key = ("workspace", name, like.dtype, like.device)
        buf = meta.cache.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            meta.cache[key] = buf
        return buf

    # -- attention ----------------------------------------------------------------------
    def _attend(self, q, k, v, mask, is_causal=False):
        """q [B, Hq, Lq, D]; k, v [B, Hk, Lk, D]; mask broadcastable to [B, 1, Lq, Lk] (True = visible)."""
        if self.logits_soft_cap is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
        b, hq, lq, d = q.shape
        hk, lk = k.shape[1], k.shape[2]
        group = hq // hk
        # the G query heads sharing a kv head become G * Lq rows: plain batched matmuls
        qg = q.reshape(b, hk, group * lq, d).float()  # [B, Hk, G * Lq, D]
        scores = torch.matmul(qg, k.float().transpose(-1, -2)) * self.scale  # [B, Hk, G * Lq, Lk]
        cap = self.logits_soft_cap
        scores = torch.tanh(scores / cap) * cap
        if is_causal:
            mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        if mask is not None:
            mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))  # [B|1, 1, Lq, Lk]
            scores = scores.view(b, hk, group, lq, lk).masked_fill(~mask.unsqueeze(2), float("-inf"))
        probs = torch.softmax(scores.view(b, hk, group * lq, lk), dim=-1)
        out = torch.matmul(probs, v.float())  # [B, Hk, G * Lq, D]
        return out.view(b, hq, lq, d).to(q.dtype)

    def _decode_inputs(self, meta: TorchAttentionMetadata, block_size: int, device: torch.device):
        """(block_ids [Nd * nb], token_idx [Nd], mask [Nd, 1, 1, nb * B]) for this window; cached per step."""
        key = ("decode", block_size, self.sliding_window)
        hit = meta.cache.get(key)
        if hit is not None:
            return hit
        base = meta.cache.get(("decode", block_size))
        if base is None:
            num_blocks = math.ceil(meta.decode_max_seq_len / block_size)
            rows = torch.tensor(meta.decode_req_indices, dtype=torch.long, device=device)
            block_ids = meta.block_table.index_select(0, rows)[:, :num_blocks].reshape(-1).long()
            token_idx = torch.tensor(meta.decode_token_indices, dtype=torch.long, device=device)
            seq_lens = meta.seq_lens.index_select(0, rows).long().unsqueeze(1)  # [Nd, 1]
            positions = torch.arange(num_blocks * block_size, device=device).unsqueeze(0)  # [1, L]
            base = (block_ids, token_idx, seq_lens, positions)
            meta.cache[("decode", block_size)] = base
        block_ids, token_idx, seq_lens, positions = base
        visible = positions < seq_lens  # [Nd, L]
        if self.sliding_window is not None:
            # the query sits at seq_len - 1; key j is visible iff j > seq_len - 1 - window
            visible &= positions >= seq_lens - self.sliding_window
        hit = (block_ids, token_idx, visible[:, None, None, :])
        meta.cache[key] = hit
        return hit

    def _prefill_inputs(self, meta, span: PrefillSpan, block_size: int, device: torch.device):
        """(block_ids [nb], mask [Lq, Lk] | None); None means plain causal (no context, no window)."""
        key = (block_size, self.sliding_window)
        if key in span.masks:
            return span.masks[key]
        num_blocks = math.ceil(span.seq_len / block_size)
        block_ids = meta.cache.get(("prefill_blocks", span.req_index))
        if block_ids is None:
            block_ids = meta.block_table[span.req_index, :num_blocks].long()
            meta.cache[("prefill_blocks", span.req_index)] = block_ids
        window = self.sliding_window
        if span.context_len == 0 and (window is None or window >= span.seq_len):
            mask = None
        else:
            q_pos = torch.arange(span.context_len, span.seq_len, device=device).unsqueeze(1)  # [Lq, 1]
            k_pos = torch.arange(span.seq_len, device=device).unsqueeze(0)  # [1, Lk]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
        span.masks[key] = (block_ids, mask)
        return span.masks[key]

    def forward(self, q, k, v, kv_cache, metadata, k_scale: float = 1.0, v_scale: float = 1.0):
        """q [T, Hq, D], k/v [T, Hk, D], kv_cache [2, num_blocks, B, Hk, D] -> [T, Hq, D]."""
        if not isinstance(metadata, TorchAttentionMetadata):
            raise TypeError(
                f"TorchAttentionBackend.forward needs the metadata from its build_metadata, got {type(metadata).__name__}"
            )
        n = metadata.num_actual_tokens
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # [num_blocks, B, Hk, D] each
        block_size = key_cache.shape[1]
        slots = metadata.slot_mapping[:n].long()
        self._write(key_cache, k[:n], slots, k_scale)
        self._write(value_cache, v[:n], slots, v_scale)

        out = torch.zeros_like(q)  # padded tokens past n stay zero
        device, dtype = q.device, q.dtype
        if metadata.decode_req_indices:
            block_ids, token_idx, mask = self._decode_inputs(metadata, block_size, device)
            num_decodes = token_idx.shape[0]
            numel = block_ids.shape[0] * key_cache[0].numel()
            # [Nd * nb * B, Hk, D] -> [Nd, L, Hk, D]
            keys = self._read(key_cache, block_ids, k_scale, dtype, self._workspace(metadata, "k", numel, q))
            values = self._read(value_cache, block_ids, v_scale, dtype, self._workspace(metadata, "v", numel, q))
            keys = keys.view(num_decodes, -1, self.num_kv_heads, self.head_size)
            values = values.view_as(keys)
            q_dec = q.index_select(0, token_idx).unsqueeze(2)  # [Nd, Hq, 1, D]
            o = self._attend(q_dec, keys.transpose(1, 2), values.transpose(1, 2), mask)  # [Nd, Hq, 1, D]
            out.index_copy_(0, token_idx, o.squeeze(2))
        for span in metadata.prefills:
            block_ids, mask = self._prefill_inputs(metadata, span, block_size, device)
            numel = block_ids.shape[0] * key_cache[0].numel()
            keys = self._read(key_cache, block_ids, k_scale, dtype, self._workspace(metadata, "k", numel, q))
            values = self._read(value_cache, block_ids, v_scale, dtype, self._workspace(metadata, "v", numel, q))
            # [nb * B, Hk, D] -> [1, Hk, seq_len, D]
            keys = keys[: span.seq_len].transpose(0, 1).unsqueeze(0)
            values = values[: span.seq_len].transpose(0, 1).unsqueeze(0)
            q_pre = q[span.token_start : span.token_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
            o = self._attend(q_pre, keys, values, mask, is_causal=mask is None)
            out[span.token_start : span.token_end] = o.squeeze(0).transpose(0, 1)
        return out

    # -- MLA (module docstring) -------------------------------------------------------------
    def _write_mla(self, cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, scale: float) -> None:
        """cache [num_blocks, B, E]; rows [n, E]; slots [n]."""
        flat = cache.view(-1, cache.shape[-1])  # [num_slots, E]
        if self.fp8_dtype is None:
            flat.index_copy_(0, slots, rows.to(flat.dtype))
            return
        fp8 = self._cache_fp8(cache)
        fmax = torch.finfo(fp8).max
        q = (rows.float() / scale).clamp_(-fmax, fmax).to(fp8)
        flat.view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))

    def _read_mla(self, cache: torch.Tensor, block_ids: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """cache [num_blocks, B, E], block_ids [n] -> [n * B, E] in ``dtype``."""
        rows = cache.view(cache.shape[0], -1)  # [num_blocks, B * E]
        if self.fp8_dtype is None:  # (.to: a 16-bit cache under a float32 model)
            return torch.index_select(rows, 0, block_ids).view(-1, cache.shape[-1]).to(dtype)
        raw = torch.index_select(rows.view(torch.uint8), 0, block_ids)
        return (raw.view(self._cache_fp8(cache)).to(dtype) * scale).view(-1, cache.shape[-1])

    def forward_mla(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                    kv_cache: torch.Tensor, metadata: Any, w_uk: torch.Tensor, w_uv: torch.Tensor,
                    k_scale: float = 1.0) -> torch.Tensor:
        """q_nope [T, H, dn], q_pe [T, H, dr], kv_c [T, r], k_pe [T, dr], kv_cache [num_blocks, B, r + dr],
        w_uk [H, dn, r], w_uv [H, dv, r] -> [T, H, dv]. Writes the step's latents, then attends."""
        if not isinstance(metadata, TorchAttentionMetadata):
            raise TypeError("TorchAttentionBackend.forward_mla needs the metadata from its build_metadata, got "
                            f"{type(metadata).__name__}")
        n = metadata.num_actual_tokens
        rank = kv_c.shape[-1]
        block_size = kv_cache.shape[1]
        self._write_mla(kv_cache, torch.cat([kv_c[:n], k_pe[:n]], dim=-1), metadata.slot_mapping[:n].long(), k_scale)
        num_heads, v_dim = w_uv.shape[0], w_uv.shape[1]
        out = q_nope.new_zeros(q_nope.shape[0], num_heads, v_dim)  # padded tokens past n stay zero
        device, dtype = q_nope.device, q_nope.dtype
        if metadata.decode_req_indices:  # absorbed: attention over the latent rows
            block_ids, token_idx, visible = self._decode_inputs(metadata, block_size, device)
            num_decodes = token_idx.shape[0]
            rows = self._read_mla(kv_cache, block_ids, k_scale, dtype).view(num_decodes, -1, kv_cache.shape[-1])
            q_lat = torch.einsum("thd,hdr->thr", q_nope.index_select(0, token_idx), w_uk)  # [Nd, H, r]
            q_full = torch.cat([q_lat, q_pe.index_select(0, token_idx)], dim=-1)  # [Nd, H, r + dr]
            scores = torch.matmul(q_full, rows.transpose(1, 2)).float() * self.scale  # [Nd, H, L]
            scores.masked_fill_(~visible.view(num_decodes, 1, -1), float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(dtype)
            o_lat = torch.matmul(probs, rows[..., :rank])  # [Nd, H, r]
            out.index_copy_(0, token_idx, torch.einsum("thr,hvr->thv", o_lat, w_uv))
        for span in metadata.prefills:  # naive: expand the latents into per-head K/V
            block_ids, mask = self._prefill_inputs(metadata, span, block_size, device)
            rows = self._read_mla(kv_cache, block_ids, k_scale, dtype)[: span.seq_len]  # [S, r + dr]
            tokens = slice(span.token_start, span.token_end)
            out[tokens] = self.mla_expanded_attention(q_nope[tokens], q_pe[tokens], rows, w_uk, w_uv, mask)
        return out

    def mla_expanded_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor, w_uk: torch.Tensor,
                               w_uv: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The naive MLA of one request: q_nope [Lq, H, dn], q_pe [Lq, H, dr], its latent rows [S, r + dr]
        expanded into per-head keys [H, S, dn + dr] and values [H, S, dv]; mask [Lq, S] (None: causal,
        no cached context) -> [Lq, H, dv]. (Also what ``benchmarks/mla_decode.py`` times decodes with.)"""
        num_heads, rank = w_uk.shape[0], w_uk.shape[2]
        latent, rope = rows[:, :rank], rows[:, rank:]
        k_nope = torch.einsum("sr,hdr->hsd", latent, w_uk)  # [H, S, dn]
        values = torch.einsum("sr,hvr->hsv", latent, w_uv)  # [H, S, dv]
        keys = torch.cat([k_nope, rope.unsqueeze(0).expand(num_heads, -1, -1)], dim=-1)  # [H, S, dn + dr]
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1).unsqueeze(0)  # [1, H, Lq, dn + dr]
        o = F.scaled_dot_product_attention(q, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask,
                                           is_causal=mask is None, scale=self.scale)
        return o.squeeze(0).transpose(0, 1)  # [Lq, H, dv]

"""Paged attention on Intel Extension for PyTorch (IPEX) kernels: XPU, and CPU when installed.

IPEX's ``ipex.llm.modules.PagedAttention`` ops have one call signature and one cache
layout on XPU and CPU, so this backend runs on both. Per step:

    reshape_and_cache               writes the step's K/V at slot_mapping
    single_query_cached_kv_attention  all decode requests (query_len == 1), one call
    flash_attn_varlen_func          all prefill / chunked-prefill requests, one call
                                    (block tables, causal, bottom-right aligned)

IPEX does NOT validate its arguments: a cache in the wrong layout SIGSEGVs (CPU:
``libintel-ext-pt-cpu.so``) or SIGFPEs the process. Every call therefore goes through a
``_checked_*`` wrapper that validates shapes, dtypes, contiguity and devices first and
raises ``ValueError`` instead. IPEX is imported only inside those wrappers.

Cache layout (one layer)::

    kv_cache [2, num_blocks, num_kv_heads, block_size, head_size]
    kv_cache[0] = key cache, kv_cache[1] = value cache, each
             [num_blocks, num_kv_heads, block_size, head_size]   (contiguous views)

IPEX's own ``reshape_and_cache`` docstring says [num_blocks, block_size, num_heads,
head_size]; that is wrong (measured): heads come before positions.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from halserve.attention_backends.base import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:  # pragma: no cover
    import torch

# halserve kv_cache_dtype -> what IPEX calls it. IPEX's fp8 KV cache is e5m2 only
# ("fp8_e4m3" raises "unsupported kv_cache_dtype").
_IPEX_KV_DTYPE = {"auto": "auto", "fp8_e5m2": "fp8"}


def _ipex_paged_attention():
    import intel_extension_for_pytorch as ipex

    return ipex.llm.modules.PagedAttention


@dataclass
class IpexAttentionMetadata:
    """The common metadata split into the step's decode part and prefill part.

    Token index tensors say where each part's tokens sit in the flattened batch; when a
    part is one contiguous run of tokens (the model runner orders decodes first) a slice
    is used instead (``*_slice``), which avoids a gather and a scatter.
    """

    common: AttentionMetadata
    slot_mapping: torch.Tensor  # [T] int64, the actual tokens only
    # decodes: requests with query_len == 1
    num_decodes: int
    decode_slice: slice | None  # tokens of the decodes when contiguous
    decode_token_idx: torch.Tensor | None  # [Nd] int64, else
    decode_block_table: torch.Tensor | None  # [Nd, max_blocks] int32, contiguous
    decode_seq_lens: torch.Tensor | None  # [Nd] int32
    decode_max_seq_len: int
    # prefills: requests with query_len > 1 (a prefill, a chunk of one, or a prefill
    # after a prefix-cache hit: the cached prefix is attended through the block table)
    num_prefills: int
    num_prefill_tokens: int
    prefill_slice: slice | None
    prefill_token_idx: torch.Tensor | None  # [Tp] int64
    prefill_cu_seqlens_q: torch.Tensor | None  # [Np + 1] int32
    prefill_cu_seqlens_kv: torch.Tensor | None  # [Np + 1] int32
    prefill_block_table: torch.Tensor | None  # [Np, max_blocks] int32, contiguous
    prefill_max_query_len: int
    prefill_max_seq_len: int


def _runs(mask: list[bool]) -> tuple[list[int], slice | None]:
    """Indices where mask is true, and a slice if they form one contiguous run."""
    idx = [i for i, m in enumerate(mask) if m]
    if idx and idx[-1] - idx[0] + 1 == len(idx):
        return idx, slice(idx[0], idx[-1] + 1)
    return idx, None


class IpexAttentionBackend(AttentionBackend):
    name = "ipex"
    platforms = ("xpu", "cpu")
    dtypes = ("float32", "float16", "bfloat16")
    kv_cache_dtypes = ("auto", "fp8_e5m2")
    supports_sliding_window = True
    supports_logits_soft_cap = True
    description = (
        "intel-extension-for-pytorch PagedAttention: reshape_and_cache, single_query_cached_kv_attention "
        "(decodes), flash_attn_varlen_func (prefills); cache [2, blocks, kv_heads, block_size, head_size]"
    )

    @classmethod
    def _supports(cls, *, dtype: str, head_size: int, block_size: int, kv_cache_dtype: str, **_: Any) -> str | None:
        if importlib.util.find_spec("intel_extension_for_pytorch") is None:
            return "intel_extension_for_pytorch is not installed"
        if kv_cache_dtype == "fp8_e5m2" and dtype == "float32":
            # single_query_cached_kv_attention: "expected scalar type Float but found Float8_e5m2"
            return "IPEX's fp8 (e5m2) KV cache needs a bfloat16 or float16 model (float32 queries are rejected)"
        return None

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, num_kv_heads, block_size, head_size)

    @classmethod
    def kv_cache_block_views(cls, kv_cache, block_size: int, num_kv_heads: int, head_size: int):
        return kv_cache[0].transpose(1, 2), kv_cache[1].transpose(1, 2)

    # -- per step ---------------------------------------------------------------------
    @classmethod
    def build_metadata(cls, common: AttentionMetadata) -> IpexAttentionMetadata:
        import torch

        qsl = common.query_start_loc_cpu.tolist()
        seq_lens = common.seq_lens_cpu.tolist()
        num_reqs = common.num_reqs
        if len(qsl) != num_reqs + 1 or len(seq_lens) != num_reqs:
            raise ValueError(
                f"query_start_loc has {len(qsl)} entries and seq_lens {len(seq_lens)} for num_reqs={num_reqs}; "
                "expected num_reqs + 1 and num_reqs"
            )
        query_lens = [qsl[r + 1] - qsl[r] for r in range(num_reqs)]
        for r, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
            if ql < 1 or sl < ql:
                raise ValueError(
                    f"request {r}: query_len {ql} and seq_len {sl}; every request needs 1 <= query_len <= seq_len"
                )
        device = common.query_start_loc.device
        is_decode = [ql == 1 for ql in query_lens]
        dec_reqs, _ = _runs(is_decode)
        pre_reqs, _ = _runs([not d for d in is_decode])

        def token_part(reqs: list[int]) -> tuple[slice | None, torch.Tensor | None, int]:
            tokens = [t for r in reqs for t in range(qsl[r], qsl[r + 1])]
            if not tokens:
                return None, None, 0
            if tokens[-1] - tokens[0] + 1 == len(tokens):
                return slice(tokens[0], tokens[-1] + 1), None, len(tokens)
            return None, torch.tensor(tokens, dtype=torch.int64, device=device), len(tokens)

        def rows(t: torch.Tensor, reqs: list[int]) -> torch.Tensor:
            if len(reqs) == num_reqs:
                return t.contiguous()
            return t.index_select(0, torch.tensor(reqs, dtype=torch.int64, device=t.device)).contiguous()

        dec_slice, dec_idx, _ = token_part(dec_reqs)
        pre_slice, pre_idx, num_pre_tokens = token_part(pre_reqs)
        pre_q = [query_lens[r] for r in pre_reqs]
        pre_kv = [seq_lens[r] for r in pre_reqs]

        def cumsum(lens: list[int]) -> torch.Tensor:
            out = [0]
            for n in lens:
                out.append(out[-1] + n)
            return torch.tensor(out, dtype=torch.int32, device=device)

        return IpexAttentionMetadata(
            common=common,
            slot_mapping=common.slot_mapping[: common.num_actual_tokens],
            num_decodes=len(dec_reqs),
            decode_slice=dec_slice,
            decode_token_idx=dec_idx,
            decode_block_table=rows(common.block_table, dec_reqs) if dec_reqs else None,
            decode_seq_lens=rows(common.seq_lens, dec_reqs).to(torch.int32) if dec_reqs else None,
            decode_max_seq_len=max((seq_lens[r] for r in dec_reqs), default=0),
            num_prefills=len(pre_reqs),
            num_prefill_tokens=num_pre_tokens,
            prefill_slice=pre_slice,
            prefill_token_idx=pre_idx,
            prefill_cu_seqlens_q=cumsum(pre_q) if pre_reqs else None,
            prefill_cu_seqlens_kv=cumsum(pre_kv) if pre_reqs else None,
            prefill_block_table=rows(common.block_table, pre_reqs) if pre_reqs else None,
            prefill_max_query_len=max(pre_q, default=0),
            prefill_max_seq_len=max(pre_kv, default=0),
        )

    # -- forward ----------------------------------------------------------------------
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None, kv_cache_dtype: str = "auto") -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, sliding_window, logits_soft_cap, kv_cache_dtype)
        if kv_cache_dtype not in _IPEX_KV_DTYPE:
            raise ValueError(
                f"kv_cache_dtype {kv_cache_dtype!r} is not supported by IPEX; use one of {', '.join(_IPEX_KV_DTYPE)}"
            )
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self._head_mapping: dict[Any, torch.Tensor] = {}

    def head_mapping(self, device: torch.device) -> torch.Tensor:
        """[num_heads] int32: query head h reads kv head h // (num_heads / num_kv_heads)."""
        import torch

        key = str(device)
        if key not in self._head_mapping:
            group = self.num_heads // self.num_kv_heads
            self._head_mapping[key] = torch.arange(self.num_heads, dtype=torch.int32, device=device) // group
        return self._head_mapping[key]

    @property
    def _window_left(self) -> int:
        # base contract: key j visible to query p iff p - sliding_window < j <= p, i.e.
        # sliding_window keys including p itself = flash-attn window_size_left of W - 1.
        return -1 if self.sliding_window is None else self.sliding_window - 1

    @property
    def _decode_window(self) -> int:
        # single_query_cached_kv_attention counts the query's own key: window_size = W
        # (measured: W - 1 drops one key).
        return -1 if self.sliding_window is None else self.sliding_window

    @property
    def _softcap(self) -> float:
        return -1.0 if not self.logits_soft_cap else float(self.logits_soft_cap)

    def forward(self, q, k, v, kv_cache, metadata: IpexAttentionMetadata, k_scale: float = 1.0, v_scale: float = 1.0):
        import torch

        if not isinstance(metadata, IpexAttentionMetadata):
            raise ValueError(
                f"IpexAttentionBackend.forward needs the metadata from IpexAttentionBackend.build_metadata, "
                f"got {type(metadata).__name__}"
            )
        num_tokens = metadata.common.num_actual_tokens
        self._check_kv_cache(kv_cache, q)
        # Padded tokens (past num_actual_tokens) are neither written nor attended.
        q_act = q[:num_tokens].contiguous()
        k_act = k[:num_tokens].contiguous()
        v_act = v[:num_tokens].contiguous()
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        kv_dtype = _IPEX_KV_DTYPE[self.kv_cache_dtype]
        scaled = kv_dtype != "auto" and (k_scale != 1.0 or v_scale != 1.0)
        if scaled:
            # IPEX (2.8, CPU) ignores k_scale/v_scale: it stores K/V unscaled and reads
            # them back unscaled. Apply them ourselves, exactly, and pass 1.0: the cache
            # holds K / k_scale and V / v_scale (what every backend stores), and
            # (q * k_scale) . (K / k_scale) = q . K, attention is linear in V.
            k_act = (k_act.float() / k_scale).to(k_act.dtype)
            v_act = (v_act.float() / v_scale).to(v_act.dtype)
            q_act = (q_act.float() * k_scale).to(q_act.dtype)
        _checked_reshape_and_cache(
            k_act, v_act, key_cache, value_cache, metadata.slot_mapping, kv_dtype, 1.0, 1.0,
            num_kv_heads=self.num_kv_heads, head_size=self.head_size,
        )
        out = torch.zeros_like(q)  # padded rows stay zero
        if metadata.num_decodes:
            q_dec = q_act[metadata.decode_slice] if metadata.decode_slice is not None else q_act.index_select(
                0, metadata.decode_token_idx)
            out_dec = torch.empty_like(q_dec)
            _checked_single_query(
                out_dec, q_dec, key_cache, value_cache, self.head_mapping(q.device), self.scale,
                metadata.decode_block_table, metadata.decode_seq_lens, metadata.decode_max_seq_len,
                window=self._decode_window, k_scale=1.0, v_scale=1.0, softcap=self._softcap,
                num_kv_heads=self.num_kv_heads, fp8=kv_dtype != "auto",
            )
            if metadata.decode_slice is not None:
                out[metadata.decode_slice] = out_dec
            else:
                out.index_copy_(0, metadata.decode_token_idx, out_dec)
        if metadata.num_prefills:
            q_pre = q_act[metadata.prefill_slice] if metadata.prefill_slice is not None else q_act.index_select(
                0, metadata.prefill_token_idx)
            out_pre = torch.empty_like(q_pre)
            _checked_varlen(
                out_pre, q_pre, key_cache, value_cache, metadata.prefill_cu_seqlens_q, metadata.prefill_cu_seqlens_kv,
                metadata.prefill_max_query_len, metadata.prefill_max_seq_len, self.scale, metadata.prefill_block_table,
                window_left=self._window_left, kv_cache_dtype=kv_dtype, k_scale=1.0, v_scale=1.0,
                softcap=self._softcap, num_kv_heads=self.num_kv_heads,
            )
            if metadata.prefill_slice is not None:
                out[metadata.prefill_slice] = out_pre
            else:
                out.index_copy_(0, metadata.prefill_token_idx, out_pre)
        if scaled:
            out = (out.float() * v_scale).to(out.dtype)
        return out

    def _check_kv_cache(self, kv_cache: torch.Tensor, q: torch.Tensor) -> None:
        import torch

        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
            raise ValueError(
                f"IPEX kv_cache must be [2, num_blocks, num_kv_heads, block_size, head_size] "
                f"(IpexAttentionBackend.kv_cache_shape), got {tuple(kv_cache.shape)}"
            )
        _, _, kvh, _, d = kv_cache.shape
        if kvh != self.num_kv_heads or d != self.head_size:
            raise ValueError(
                f"IPEX kv_cache {tuple(kv_cache.shape)} does not match num_kv_heads={self.num_kv_heads}, "
                f"head_size={self.head_size} in the layout [2, num_blocks, num_kv_heads, block_size, head_size] "
                "(a cache allocated for another backend's layout?)"
            )
        want = q.dtype if self.kv_cache_dtype == "auto" else torch.float8_e5m2
        if kv_cache.dtype != want:
            raise ValueError(
                f"IPEX kv_cache dtype is {kv_cache.dtype} but kv_cache_dtype={self.kv_cache_dtype!r} "
                f"with {q.dtype} queries needs {want}"
            )
        if q.dim() != 3 or q.shape[1] != self.num_heads or q.shape[2] != self.head_size:
            raise ValueError(
                f"q must be [num_tokens, num_heads={self.num_heads}, head_size={self.head_size}], got {tuple(q.shape)}"
            )


# -- validated IPEX calls ---------------------------------------------------------------
# Each checks every argument IPEX would dereference, then calls the kernel. IPEX reads
# raw pointers with the strides it assumes, so contiguity matters as much as shape.


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"IPEX paged attention: {msg}")


def _desc(t: Any) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}" if hasattr(t, "shape") else repr(t)


def _check_tensor(name: str, t: Any, *, dims: int, dtype: Any = None, dtypes: tuple = (), device: Any = None) -> None:
    import torch

    _check(isinstance(t, torch.Tensor), f"{name} must be a tensor, got {type(t).__name__}")
    _check(t.dim() == dims, f"{name} must have {dims} dims, got {_desc(t)}")
    if dtype is not None:
        _check(t.dtype == dtype, f"{name} must be {dtype}, got {_desc(t)}")
    if dtypes:
        _check(t.dtype in dtypes, f"{name} must be one of {dtypes}, got {_desc(t)}")
    _check(t.is_contiguous(), f"{name} must be contiguous, got strides {t.stride()} for {_desc(t)}")
    if device is not None:
        _check(t.device == device, f"{name} is on {t.device}, expected {device}")


def _check_cache_pair(key_cache: Any, value_cache: Any, device: Any, num_kv_heads: int, head_size: int) -> None:
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check_tensor(name, c, dims=4, device=device)
    _check(
        key_cache.shape == value_cache.shape and key_cache.dtype == value_cache.dtype,
        f"key_cache {_desc(key_cache)} and value_cache {_desc(value_cache)} differ",
    )
    _check(
        key_cache.shape[1] == num_kv_heads and key_cache.shape[3] == head_size,
        f"caches must be [num_blocks, num_kv_heads={num_kv_heads}, block_size, head_size={head_size}], "
        f"got {tuple(key_cache.shape)}",
    )


def _check_values_on_cpu(name: str, t: torch.Tensor, low: int, high: int) -> None:
    # Out-of-range indices make IPEX read/write out of bounds. Checking them costs a
    # device sync, so it is done where it is free: tensors on the host.
    if t.device.type == "cpu" and t.numel():
        lo, hi = int(t.min()), int(t.max())
        _check(low <= lo and hi < high, f"{name} values must lie in [{low}, {high}), got [{lo}, {hi}]")


def _checked_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, *,
                               num_kv_heads: int, head_size: int) -> None:
    import torch

    device = key_cache.device if isinstance(key_cache, torch.Tensor) else None
    _check_cache_pair(key_cache, value_cache, device, num_kv_heads, head_size)
    for name, t in (("key", key), ("value", value)):
        _check_tensor(name, t, dims=3, device=device)
        _check(t.shape[1:] == (num_kv_heads, head_size),
               f"{name} must be [num_tokens, num_kv_heads={num_kv_heads}, head_size={head_size}], got {_desc(t)}")
    _check(key.shape == value.shape, f"key {_desc(key)} and value {_desc(value)} differ")
    _check_tensor("slot_mapping", slot_mapping, dims=1, dtypes=(torch.int64, torch.int32), device=device)
    _check(slot_mapping.shape[0] == key.shape[0],
           f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    if kv_cache_dtype == "auto":
        _check(key_cache.dtype == key.dtype, f"cache dtype {key_cache.dtype} != key dtype {key.dtype} (kv_cache_dtype auto)")
    else:
        _check(key_cache.dtype == torch.float8_e5m2, f"fp8 KV cache must be float8_e5m2, got {key_cache.dtype}")
    num_blocks, _, block_size, _ = key_cache.shape
    _check_values_on_cpu("slot_mapping", slot_mapping, 0, num_blocks * block_size)
    _ipex_paged_attention().reshape_and_cache(
        key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)


def _check_block_values(block_tables, seq_lens, block_size: int, num_blocks: int) -> None:
    """The blocks each request reads (its first ceil(seq_len / block_size)) must exist."""
    import torch

    if block_tables.device.type != "cpu" or not block_tables.numel():
        return
    needed = (seq_lens.to(torch.int64) + block_size - 1) // block_size  # [R]
    used = torch.arange(block_tables.shape[1]).unsqueeze(0) < needed.unsqueeze(1)  # [R, max_blocks]
    _check_values_on_cpu("block_tables (the blocks each request reads)", block_tables[used], 0, num_blocks)


def _check_tables(block_tables, seq_lens, num_reqs: int, num_blocks: int, block_size: int, max_seq_len: int, device) -> None:
    import torch

    _check_tensor("block_tables", block_tables, dims=2, dtype=torch.int32, device=device)
    _check_tensor("seq_lens", seq_lens, dims=1, dtype=torch.int32, device=device)
    _check(block_tables.shape[0] == num_reqs and seq_lens.shape[0] == num_reqs,
           f"block_tables {_desc(block_tables)} and seq_lens {_desc(seq_lens)} must have {num_reqs} rows")
    _check(block_tables.shape[1] * block_size >= max_seq_len,
           f"block_tables has {block_tables.shape[1]} blocks per request ({block_tables.shape[1] * block_size} "
           f"positions) but the longest sequence is {max_seq_len}")
    _check_values_on_cpu("seq_lens", seq_lens, 1, max_seq_len + 1)
    _check_block_values(block_tables, seq_lens, block_size, num_blocks)


def _checked_single_query(out, query, key_cache, value_cache, head_mapping, scale, block_tables, seq_lens, max_seq_len,
                          *, window: int, k_scale: float, v_scale: float, softcap: float, num_kv_heads: int,
                          fp8: bool) -> None:
    import torch

    device = query.device
    _check_tensor("query", query, dims=3, dtypes=(torch.float32, torch.float16, torch.bfloat16), device=device)
    head_size = query.shape[2]
    _check_cache_pair(key_cache, value_cache, device, num_kv_heads, head_size)
    _check_tensor("output", out, dims=3, dtype=query.dtype, device=device)
    _check(out.shape == query.shape, f"output {_desc(out)} must match query {_desc(query)}")
    _check_tensor("head_mapping", head_mapping, dims=1, dtype=torch.int32, device=device)
    _check(head_mapping.shape[0] == query.shape[1], f"head_mapping {_desc(head_mapping)} needs {query.shape[1]} entries")
    if fp8:
        _check(query.dtype != torch.float32, "fp8 KV cache needs bfloat16/float16 queries")
    else:
        _check(key_cache.dtype == query.dtype, f"cache dtype {key_cache.dtype} != query dtype {query.dtype}")
    num_blocks, _, block_size, _ = key_cache.shape
    _check_tables(block_tables, seq_lens, query.shape[0], num_blocks, block_size, max_seq_len, device)
    _ipex_paged_attention().single_query_cached_kv_attention(
        out, query, key_cache, value_cache, head_mapping, float(scale), block_tables, seq_lens, block_size,
        int(max_seq_len), None, window, k_scale, v_scale, softcap)


def _checked_varlen(out, query, key_cache, value_cache, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, scale,
                    block_tables, *, window_left: int, kv_cache_dtype: str, k_scale: float, v_scale: float,
                    softcap: float, num_kv_heads: int) -> None:
    import torch

    device = query.device
    _check_tensor("query", query, dims=3, dtypes=(torch.float32, torch.float16, torch.bfloat16), device=device)
    head_size = query.shape[2]
    _check_cache_pair(key_cache, value_cache, device, num_kv_heads, head_size)
    _check_tensor("output", out, dims=3, dtype=query.dtype, device=device)
    _check(out.shape == query.shape, f"output {_desc(out)} must match query {_desc(query)}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv)):
        _check_tensor(name, t, dims=1, dtype=torch.int32, device=device)
    num_reqs = cu_seqlens_q.shape[0] - 1
    _check(num_reqs >= 1 and cu_seqlens_kv.shape[0] == num_reqs + 1,
           f"cu_seqlens_q {_desc(cu_seqlens_q)} and cu_seqlens_kv {_desc(cu_seqlens_kv)} need num_reqs + 1 entries")
    if device.type == "cpu":
        _check(int(cu_seqlens_q[-1]) == query.shape[0],
               f"cu_seqlens_q ends at {int(cu_seqlens_q[-1])} but query has {query.shape[0]} tokens")
        q_lens, kv_lens = cu_seqlens_q.diff(), cu_seqlens_kv.diff()
        _check(bool((q_lens >= 1).all()) and bool((kv_lens >= q_lens).all()),
               f"every request needs 1 <= query_len <= kv_len; q_lens {q_lens.tolist()}, kv_lens {kv_lens.tolist()}")
    if kv_cache_dtype == "auto":
        _check(key_cache.dtype == query.dtype, f"cache dtype {key_cache.dtype} != query dtype {query.dtype}")
    num_blocks, _, block_size, _ = key_cache.shape
    _check_tensor("block_tables", block_tables, dims=2, dtype=torch.int32, device=device)
    _check(block_tables.shape[0] == num_reqs, f"block_tables {_desc(block_tables)} must have {num_reqs} rows")
    _check(block_tables.shape[1] * block_size >= max_seqlen_kv,
           f"block_tables covers {block_tables.shape[1] * block_size} positions, the longest kv is {max_seqlen_kv}")
    if device.type == "cpu":
        _check(int(kv_lens.max()) <= max_seqlen_kv, f"max_seqlen_kv {max_seqlen_kv} < longest kv {int(kv_lens.max())}")
        _check_block_values(block_tables, kv_lens, block_size, num_blocks)
    _ipex_paged_attention().flash_attn_varlen_func(
        out, query, key_cache, value_cache, cu_seqlens_q, cu_seqlens_kv, int(max_seqlen_q), int(max_seqlen_kv),
        float(scale), True, block_tables, None, window_left, -1, kv_cache_dtype, k_scale, v_scale, softcap)

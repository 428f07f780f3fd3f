"""Triton unified paged attention (CUDA and ROCm): one launch for a mixed batch.

The kernels live in ``triton_paged_kernels.py`` and are imported at first use, so listing
this backend (``halserve plugins``) never imports triton. A step is two launches: the
cache write of all new K/V, then attention over the cache for every query token (chunked
prefills after a prefix hit and decodes alike). Decode-only steps with long contexts on a
GPU add a split-K launch and a reduce (see ``num_kv_splits``) and a deeper software pipeline
(``triton_paged_kernels.pipeline_stages``). ``HALSERVE_TRITON_ATTN_SPLITS`` and
``HALSERVE_TRITON_ATTN_STAGES`` force either (tests, benchmark sweeps).

MLA layers (DeepSeek-V2/V3, ``forward_mla``; the latent cache of ``halserve.kv_cache.spec.MLASpec``):
the latent write, then decodes absorbed over the latent rows (``triton_paged_mla_kernels``: W_UK and
W_UV applied by torch around the kernel, split-K as above), then prefills expanded: their requests'
latent rows gathered (dequantized for fp8), expanded through W_UK / W_UV into per-head keys and
values laid out as a paged cache of their own, and attended by the unified kernel above in one
launch. A decode-only step reads no host tensor (graph capture); a step with prefills splits its
batch on the host (``query_start_loc_cpu``), as the torch backend does.
"""
from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any, ClassVar

from halserve.attention_backends.base import AttentionBackend

if TYPE_CHECKING:  # pragma: no cover
    import torch

# kv_cache_dtype names accepted, and the torch cache dtypes each may be allocated as
# ("fp8" / "fp8_e4m3" is the platform's e4m3 flavour: e4m3fn on CUDA, e4m3fnuz on MI300).
_FP8_CACHE_DTYPES = {
    "fp8": ("float8_e4m3fn", "float8_e4m3fnuz"),
    "fp8_e4m3": ("float8_e4m3fn", "float8_e4m3fnuz"),
    "fp8_e5m2": ("float8_e5m2",),
}


def _forced(name: str) -> int | None:
    """A tuning override from the environment (tests, benchmark sweeps); None when unset."""
    value = os.environ.get(name)
    if not value:
        return None
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}; unset it for the automatic choice")
    return int(value)


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dimension is contiguous (the kernels take the other strides)."""
    return x if x.stride(-1) == 1 else x.contiguous()


class TritonPagedAttentionBackend(AttentionBackend):
    name = "triton_paged"
    platforms = ("cuda", "rocm")
    dtypes = ("float16", "bfloat16", "float32")
    head_sizes = (64, 80, 96, 128, 256)
    block_sizes = (16, 32, 64)
    kv_cache_dtypes = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    supports_sliding_window = True
    supports_logits_soft_cap = True
    # (max_seq_len only picks the split-K factor: a graph captured at max_model_len keeps its
    # split count, and empty splits add nothing; triton_paged_kernels.reduce_splits_kernel)
    supports_graph_capture = True
    description = (
        "Triton unified paged attention: one kernel for chunked prefill (causal over a cached prefix) "
        "and decode, GQA/MQA packed into tl.dot tiles, split-K decode for long contexts, "
        "fp8 KV cache with per-tensor scales"
    )

    max_splits: ClassVar[int] = 8
    """Upper bound of the split-K factor of a decode step (the largest one measured)."""
    unsplit_programs_per_sm: ClassVar[int] = 3
    """A decode step with at least this many (request, kv head) programs per SM does not split."""
    split_programs_per_sm: ClassVar[int] = 6
    """A split decode step doubles its factor until it has this many programs per SM."""
    min_split_context: ClassVar[int] = 512
    """Decode steps whose longest context is shorter stay on the single-pass kernel."""

    @classmethod
    def _supports(cls, **config: Any) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install 'halserve[cuda]' or 'halserve[rocm]')"
        return None

    @classmethod
    def kv_cache_spec_kinds(cls) -> tuple[str, ...]:
        return ("full_attention", "sliding_window", "mla")

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {
            **super().describe(),
            "gqa": True,
            "fp8_kv_cache_torch_dtypes": {k: list(v) for k, v in _FP8_CACHE_DTYPES.items()},
            "split_kv_decode": True,
        }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        from halserve.attention_backends import triton_paged_kernels, triton_paged_mla_kernels

        self._kernels = triton_paged_kernels
        self._mla_kernels = triton_paged_mla_kernels
        self._num_sms: int | None = None

    # -- split-K policy -------------------------------------------------------------------
    def num_kv_splits(self, metadata: Any, device: torch.device) -> int:
        """How many programs share one (request, kv head)'s context this step.

        Only decode-only steps with long contexts split: there the grid is (requests x kv
        heads) programs, too few to keep every SM streaming. ``HALSERVE_TRITON_ATTN_SPLITS``
        forces a value (tests, benchmarks).

        Measured on an H100 and an H200 (132 SMs each; heads 32/8, head size 128, bf16, block 16;
        BENCHMARKS.md, ``bench_paged_attention.py --grid``): from 512 programs (batch 64) up, the
        single pass was fastest (84-89% of peak; splitting in two cost 4-15 points); below, the
        best split reached about 1024 programs (batch 32 in 4, batch 16 in 8).
        """
        forced = _forced("HALSERVE_TRITON_ATTN_SPLITS")
        if forced is not None:
            return forced
        if metadata.max_query_len != 1 or metadata.max_seq_len < self.min_split_context or device.type != "cuda":
            return 1
        if self._num_sms is None:
            import torch

            self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        programs = metadata.num_reqs * self.num_kv_heads
        if programs >= self.unsplit_programs_per_sm * self._num_sms:
            return 1
        splits = 1
        # double up to ~6 programs per SM, each still streaming >= 256 keys
        while (
            splits < self.max_splits
            and programs * splits < self.split_programs_per_sm * self._num_sms
            and metadata.max_seq_len // (splits * 2) >= 256
        ):
            splits *= 2
        return splits

    # -- per step -------------------------------------------------------------------------
    def _check_cache_dtype(self, kv_cache: torch.Tensor) -> None:
        if self.kv_cache_dtype != "auto":
            allowed = _FP8_CACHE_DTYPES[self.kv_cache_dtype]
            if str(kv_cache.dtype).removeprefix("torch.") not in allowed:
                raise ValueError(
                    f"kv_cache_dtype {self.kv_cache_dtype!r} needs a cache tensor of dtype {' or '.join(allowed)}, "
                    f"got {kv_cache.dtype}"
                )

    def forward(self, q, k, v, kv_cache, metadata, k_scale: float = 1.0, v_scale: float = 1.0):
        import torch

        num_tokens = metadata.num_actual_tokens
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        self._check_cache_dtype(kv_cache)
        num_splits = self.num_kv_splits(metadata, q.device)
        num_stages = _forced("HALSERVE_TRITON_ATTN_STAGES")  # None: the launcher's choice (pipeline_stages)
        # 1. every new K/V of the step first, so queries see their own chunk
        self._kernels.write_kv_cache(
            k[:num_tokens], v[:num_tokens], key_cache, value_cache, metadata.slot_mapping[:num_tokens], k_scale, v_scale
        )
        # 2. attend; rows past num_actual_tokens (padding) are zeros
        out = torch.zeros_like(q) if q.shape[0] > num_tokens else torch.empty_like(q)
        self._kernels.paged_attention(
            out[:num_tokens],
            q[:num_tokens],
            key_cache,
            value_cache,
            metadata.block_table,
            metadata.seq_lens,
            metadata.query_start_loc,
            num_reqs=metadata.num_reqs,
            max_query_len=metadata.max_query_len,
            scale=self.scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            k_scale=k_scale,
            v_scale=v_scale,
            num_splits=num_splits,
            num_stages=num_stages,
        )
        return out

    # -- MLA (module docstring) -------------------------------------------------------------
    def forward_mla(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                    kv_cache: torch.Tensor, metadata: Any, w_uk: torch.Tensor, w_uv: torch.Tensor,
                    k_scale: float = 1.0) -> torch.Tensor:
        """q_nope [T, H, dn], q_pe [T, H, dr], kv_c [T, r], k_pe [T, dr], kv_cache [num_blocks, B, r + dr],
        w_uk [H, dn, r], w_uv [H, dv, r] -> [T, H, dv]. Writes the step's latents, then attends."""
        import torch

        self._check_cache_dtype(kv_cache)
        n = metadata.num_actual_tokens
        self._mla_kernels.write_mla_cache(_unit_stride(kv_c[:n]), _unit_stride(k_pe[:n]), kv_cache,
                                          metadata.slot_mapping[:n], k_scale)
        num_heads, v_dim = w_uv.shape[0], w_uv.shape[1]
        out = q_nope.new_zeros(q_nope.shape[0], num_heads, v_dim)  # padded tokens past n stay zero
        if metadata.max_query_len <= 1:  # decode-only: no host tensor read (graph capture)
            out[:n] = self._mla_decode(q_nope[:n], q_pe[:n], kv_cache, metadata, w_uk, w_uv, k_scale, None)
            return out
        starts = metadata.query_start_loc_cpu.tolist()
        query_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
        decode_tokens = [starts[r] for r, q_len in enumerate(query_lens) if q_len == 1]
        if decode_tokens:
            index = torch.tensor(decode_tokens, dtype=torch.long, device=q_nope.device)
            out.index_copy_(0, index, self._mla_decode(q_nope[:n], q_pe[:n], kv_cache, metadata, w_uk, w_uv,
                                                       k_scale, index))
        prefill_reqs = [r for r, q_len in enumerate(query_lens) if q_len > 1]
        if prefill_reqs:
            self._mla_prefill(out, q_nope, q_pe, kv_cache, metadata, w_uk, w_uv, k_scale, prefill_reqs, starts)
        return out

    def _mla_decode(self, q_nope, q_pe, kv_cache, metadata, w_uk, w_uv, k_scale: float, index) -> torch.Tensor:
        """The absorbed path for the tokens ``index`` (None: all of them, a decode-only step) -> [Nd, H, dv]."""
        import torch

        if index is None:
            q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)  # [T, H, r]
        else:  # (rows of prefill tokens stay unset: the kernel skips them)
            q_lat = q_nope.new_empty(q_nope.shape[0], w_uk.shape[0], w_uk.shape[2])
            q_lat.index_copy_(0, index, torch.einsum("thd,hdr->thr", q_nope.index_select(0, index), w_uk))
        o_lat = torch.empty_like(q_lat)
        self._mla_kernels.mla_decode(
            o_lat, q_lat, _unit_stride(q_pe), kv_cache, metadata.block_table, metadata.seq_lens,
            metadata.query_start_loc, num_reqs=metadata.num_reqs, scale=self.scale, k_scale=k_scale,
            num_splits=self.num_kv_splits(metadata, q_nope.device),
        )
        if index is not None:
            o_lat = o_lat.index_select(0, index)
        return torch.einsum("thr,hvr->thv", o_lat, w_uv)  # [Nd, H, dv]

    def _mla_prefill(self, out, q_nope, q_pe, kv_cache, metadata, w_uk, w_uv, k_scale: float,
                     reqs: list[int], starts: list[int]) -> None:
        """The naive path of every prefill request in one launch of the unified kernel: their latent rows,
        expanded into per-head K [S, H, D] and V [S, H, D] (D = max(dn + dr, dv), zero-padded), laid out
        block by block as a paged cache of their own::

            request a: blocks 0 .. na-1 | request b: blocks na .. na+nb-1 | ...   (block table rows: ranges)
        """
        import torch

        block_size = kv_cache.shape[1]
        num_heads, nope, rank = w_uk.shape
        rope, v_dim = q_pe.shape[2], w_uv.shape[1]
        head = max(nope + rope, v_dim)
        device = q_nope.device
        seq_lens = metadata.seq_lens_cpu.tolist()
        num_blocks = [-(-seq_lens[r] // block_size) for r in reqs]
        block_ids = torch.cat([metadata.block_table[r, :nb] for r, nb in zip(reqs, num_blocks)]).long()
        if kv_cache.dtype in self._kernels.FP8_DTYPES:  # (CPU tensors have no fp8 index_select: the bytes)
            raw = kv_cache.view(torch.uint8).index_select(0, block_ids).view(kv_cache.dtype)
            rows = raw.view(-1, kv_cache.shape[-1]).to(q_nope.dtype) * k_scale  # [N, r + dr]
        else:
            rows = kv_cache.index_select(0, block_ids).view(-1, kv_cache.shape[-1])  # [N, r + dr]
        keys = q_nope.new_zeros(rows.shape[0], num_heads, head)
        keys[..., :nope] = torch.einsum("sr,hdr->shd", rows[:, :rank], w_uk)
        keys[..., nope:nope + rope] = rows[:, None, rank:]
        values = q_nope.new_zeros(rows.shape[0], num_heads, head)
        values[..., :v_dim] = torch.einsum("sr,hvr->shv", rows[:, :rank], w_uv)
        tokens = torch.cat([torch.arange(starts[r], starts[r + 1]) for r in reqs]).to(device)
        q = q_nope.new_zeros(tokens.shape[0], num_heads, head)
        q[..., :nope] = q_nope.index_select(0, tokens)
        q[..., nope:nope + rope] = q_pe.index_select(0, tokens)
        table = torch.zeros(len(reqs), max(num_blocks), dtype=torch.int32)
        first = 0
        for i, nb in enumerate(num_blocks):
            table[i, :nb] = torch.arange(first, first + nb, dtype=torch.int32)
            first += nb
        query_lens = [starts[r + 1] - starts[r] for r in reqs]
        qsl = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        o = torch.empty_like(q)
        self._kernels.paged_attention(
            o, q, keys.view(-1, block_size, num_heads, head), values.view(-1, block_size, num_heads, head),
            table.to(device), torch.tensor([seq_lens[r] for r in reqs], dtype=torch.int32, device=device),
            qsl.to(device), num_reqs=len(reqs), max_query_len=max(query_lens), scale=self.scale,
        )
        out.index_copy_(0, tokens, o[..., :v_dim])


class RocmTritonPagedAttentionBackend(TritonPagedAttentionBackend):
    """The same kernels, registered by the rocm plugin under its own name (names are unique
    across plugins, and the rocm plugin must not depend on the cuda plugin being enabled).
    An fp8 cache on MI300 (gfx94x) is float8_e4m3fnuz; MI350 uses OCP float8_e4m3fn."""

    name = "triton_paged_rocm"
    platforms = ("rocm",)

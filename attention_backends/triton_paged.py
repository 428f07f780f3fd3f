"""Triton unified paged attention (CUDA and ROCm): one launch for a mixed batch.

The kernels live in ``triton_paged_kernels.py`` and are imported at first use, so listing
this backend (``halserve plugins``) never imports triton. A step is two launches: the
cache write of all new K/V, then attention over the cache for every query token (chunked
prefills after a prefix hit and decodes alike). Decode-only steps with long contexts on a
GPU add a split-K launch and a reduce (see ``num_kv_splits``) and a deeper software pipeline
(``triton_paged_kernels.pipeline_stages``). ``HALSERVE_TRITON_ATTN_SPLITS`` and
``HALSERVE_TRITON_ATTN_STAGES`` force either (tests, benchmark sweeps).
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
        from halserve.attention_backends import triton_paged_kernels

        self._kernels = triton_paged_kernels
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
    def forward(self, q, k, v, kv_cache, metadata, k_scale: float = 1.0, v_scale: float = 1.0):
        import torch

        num_tokens = metadata.num_actual_tokens
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if self.kv_cache_dtype != "auto":
            allowed = _FP8_CACHE_DTYPES[self.kv_cache_dtype]
            if str(kv_cache.dtype).removeprefix("torch.") not in allowed:
                raise ValueError(
                    f"kv_cache_dtype {self.kv_cache_dtype!r} needs a cache tensor of dtype {' or '.join(allowed)}, "
                    f"got {kv_cache.dtype}"
                )
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


class RocmTritonPagedAttentionBackend(TritonPagedAttentionBackend):
    """The same kernels, registered by the rocm plugin under its own name (names are unique
    across plugins, and the rocm plugin must not depend on the cuda plugin being enabled).
    An fp8 cache on MI300 (gfx94x) is float8_e4m3fnuz; MI350 uses OCP float8_e4m3fn."""

    name = "triton_paged_rocm"
    platforms = ("rocm",)

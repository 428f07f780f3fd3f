"""The attention-backend interface: write the step's K/V into the paged cache, attend.

Batch layout (flattened varlen, as in vLLM V1). For one step with R requests and T
scheduled tokens in total::

    q                [T, num_heads, head_size]      all requests' new tokens, concatenated
    query_start_loc  [R + 1] int32                  request r owns q[query_start_loc[r]:query_start_loc[r+1]]
    seq_lens         [R] int32                      context length of r *including* this step's tokens
    block_table      [R, max_blocks_per_req] int32  physical block ids of r, in order
    slot_mapping     [T] int64                      where token t's K/V goes: block_id * block_size + offset

A request's new tokens are the last ``query_len`` positions of its context, so token i
of request r sits at position ``seq_lens[r] - query_len_r + i``; it may attend to every
cached position <= its own (causal), within ``sliding_window`` if set: key position j
is visible to query position p iff ``p - sliding_window < j <= p``.

    block_table[r] = [7, 2, 9]      block_size = 4
    position:   0 1 2 3 | 4 5 6 7 | 8 9 ...
    block:      7 7 7 7 | 2 2 2 2 | 9 9
    slot of position 5 = 2 * 4 + 1 = 9
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # pragma: no cover
    import torch

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
"""``auto`` stores K/V in the model dtype (a GGUF checkpoint computed in float32: float16, as llama.cpp's default
``-ctk f16``, where its attention backend takes it: ``models.loader.gguf_kv_cache_default``); ``float32``,
``bfloat16`` and ``float16`` store them in that type whatever the model computes in (a 16-bit cache under a
float32 model: half the bytes a decode step reads; float16 has 3 more mantissa bits than bfloat16 and a range
to 65504); ``fp8`` is the platform's e4m3 flavour."""


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, fp8_e4m3: str | None = None) -> torch.dtype:
    """The element type of the cache tensor for a ``kv_cache_dtype`` setting; ``fp8_e4m3`` names the platform's
    e4m3 flavour for ``fp8``/``fp8_e4m3`` (``Platform.fp8_e4m3_dtype()``; default ``float8_e4m3fn``)."""
    import torch

    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("float32", "bfloat16", "float16"):
        return getattr(torch, kv_cache_dtype)
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return getattr(torch, fp8_e4m3 or "float8_e4m3fn")
    if kv_cache_dtype == "fp8_e5m2":
        return torch.float8_e5m2
    raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; use one of {', '.join(KV_CACHE_DTYPES)}")


@dataclass
class AttentionMetadata:
    """What every backend gets for one step; built once per step by the model runner."""

    num_actual_tokens: int  # T: tokens scheduled this step (q may be padded past it)
    num_reqs: int  # R
    max_query_len: int  # longest query_len this step (1 for a pure-decode step)
    max_seq_len: int  # longest seq_len this step
    query_start_loc: torch.Tensor  # [R + 1] int32, on the device
    seq_lens: torch.Tensor  # [R] int32, on the device
    block_table: torch.Tensor  # [R, max_blocks_per_req] int32, on the device
    slot_mapping: torch.Tensor  # [T] int64, on the device
    query_start_loc_cpu: torch.Tensor  # the same, on the host (no device sync to read it)
    seq_lens_cpu: torch.Tensor  # the same, on the host


class AttentionBackend:
    """One paged-attention implementation. Subclasses set the class attributes.

    Lifecycle: the model runner picks the backend (the platform's preferred list, first
    whose ``supports`` returns None), allocates each layer's cache with
    ``kv_cache_shape``, calls ``build_metadata`` once per step and each attention
    layer calls ``forward``.
    """

    name: ClassVar[str]
    """Unique name, e.g. ``"triton_paged"``."""
    platforms: ClassVar[tuple[str, ...]]
    """Platforms it runs on; ``("*",)`` for any."""
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "float16", "bfloat16")
    head_sizes: ClassVar[tuple[int, ...] | None] = None
    """Supported head sizes, or None for any."""
    block_sizes: ClassVar[tuple[int, ...] | None] = None
    """Supported KV block sizes, or None for any."""
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    supports_sliding_window: ClassVar[bool] = False
    supports_logits_soft_cap: ClassVar[bool] = False
    supports_graph_capture: ClassVar[bool] = False
    """Whether a decode step's ``forward`` may be recorded in a device graph and replayed: it reads
    every per-step value from the metadata's device tensors (not ``*_cpu`` nor ``max_seq_len``, which a
    replay does not update; ``halserve.worker.step_graphs``)."""
    description: ClassVar[str] = ""

    # -- what it supports -------------------------------------------------------------
    @classmethod
    def supports(
        cls,
        *,
        dtype: str,
        head_size: int,
        block_size: int,
        kv_cache_dtype: str = "auto",
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
    ) -> str | None:
        """``None`` if this backend can run the configuration, else a human reason."""
        if dtype not in cls.dtypes:
            return f"dtype {dtype} not supported (supports {', '.join(cls.dtypes)})"
        if cls.head_sizes is not None and head_size not in cls.head_sizes:
            return f"head size {head_size} not supported (supports {', '.join(map(str, cls.head_sizes))})"
        if cls.block_sizes is not None and block_size not in cls.block_sizes:
            return f"block size {block_size} not supported (supports {', '.join(map(str, cls.block_sizes))})"
        if kv_cache_dtype not in cls.kv_cache_dtypes:
            return f"kv cache dtype {kv_cache_dtype!r} not supported (supports {', '.join(cls.kv_cache_dtypes)})"
        if sliding_window is not None and not cls.supports_sliding_window:
            return "sliding window attention not supported"
        if logits_soft_cap is not None and not cls.supports_logits_soft_cap:
            return "logits soft-cap not supported"
        if num_heads is not None and num_kv_heads is not None and num_heads % num_kv_heads:
            return f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        return cls._supports(dtype=dtype, head_size=head_size, block_size=block_size, kv_cache_dtype=kv_cache_dtype)

    @classmethod
    def _supports(cls, **config: Any) -> str | None:
        """(optional) default: None. Extra checks (e.g. "flash_attn is not installed")."""
        return None

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {
            "platforms": list(cls.platforms),
            "dtypes": list(cls.dtypes),
            "head_sizes": list(cls.head_sizes) if cls.head_sizes is not None else "any",
            "block_sizes": list(cls.block_sizes) if cls.block_sizes is not None else "any",
            "kv_cache_dtypes": list(cls.kv_cache_dtypes),
            "sliding_window": cls.supports_sliding_window,
            "logits_soft_cap": cls.supports_logits_soft_cap,
            "kv_cache_spec_kinds": list(cls.kv_cache_spec_kinds()),
            "description": cls.description,
        }

    @classmethod
    def kv_cache_spec_kinds(cls) -> tuple[str, ...]:
        """The KV-cache spec kinds (halserve.kv_cache.known_spec_kinds; a plugin may register its own) whose
        layers it serves; ``mla`` needs ``forward_mla`` (see TorchAttentionBackend). The conformance kit
        checks each one claimed. (optional) default:
        full attention, and sliding windows when ``supports_sliding_window`` (they read the same paged
        layout; a released window block reads as whatever the block holds now, always masked out)."""
        return ("full_attention", "sliding_window") if cls.supports_sliding_window else ("full_attention",)

    @classmethod
    def runs_on(cls, platform: str) -> bool:
        return "*" in cls.platforms or platform in cls.platforms

    # -- cache layout -----------------------------------------------------------------
    @classmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor (optional) default: [2, blocks, block_size, kv_heads, head_size]
        (index 0 holds keys, 1 values)."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def kv_cache_block_views(cls, kv_cache: Any, block_size: int, num_kv_heads: int, head_size: int) -> tuple:
        """``kv_cache`` (this backend's shape) as two views, keys and values, each ``[num_blocks,
        block_size, num_kv_heads, head_size]``, so KV connectors move blocks in one layout whatever
        the backend. A backend with its own ``kv_cache_shape`` overrides this too."""
        return kv_cache[0], kv_cache[1]

    # -- per step ---------------------------------------------------------------------
    @classmethod
    def build_metadata(cls, common: AttentionMetadata) -> Any:
        """Backend-specific metadata for one step, built once and shared by all layers
        (optional) default: the common metadata itself."""
        return common

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.kv_cache_dtype = kv_cache_dtype

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_size]
        k: torch.Tensor,  # [T, num_kv_heads, head_size]
        v: torch.Tensor,  # [T, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # kv_cache_shape(...)
        metadata: Any,  # what build_metadata returned
        k_scale: float = 1.0,  # per-tensor fp8 scales (used when kv_cache_dtype is fp8)
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [T, num_heads, head_size]
        """Write this step's K/V to the cache at ``slot_mapping``, then attend."""
        raise NotImplementedError

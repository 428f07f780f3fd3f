"""Paged attention for XLA devices: Pallas ragged paged attention on a TPU, an XLA-friendly
pure-torch fallback elsewhere (the XLA CPU device in tests).

Cache layout (one layer) is the one torch-xla's ragged_paged_attention (v2) kernel reads,
keys and values interleaved along the head axis::

    kv_cache [num_blocks, block_size, 2 * num_kv_heads, head_size]
    kv_cache[b, s, 2 * h]     = key of kv head h at slot s of block b
    kv_cache[b, s, 2 * h + 1] = its value

Static shapes: on XLA every distinct input shape is a new graph compilation, so the
model runner pads each step to buckets (``halserve.worker.xla_buckets``): q, k, v and
slot_mapping to T_pad tokens (padded tokens write into the null block 0), and
query_start_loc / seq_lens / block_table to R_pad requests with a fixed block-table
width. Nothing here reads ``num_actual_tokens``, ``num_reqs``, ``max_query_len`` or
``max_seq_len`` to size a tensor, calls ``.item()`` or branches on tensor values in
``forward``: shapes come from the tensors, the per-token request/position indices are
built on the host in ``build_metadata`` and shipped as data.

Never call ``torch.ops.xla.ragged_paged_attention`` (or torch-xla's Pallas wrapper) on
anything but a TPU: on CPU tensors it returns ``empty_like(q)`` (garbage) with only a
warning, and on XLA:CPU the kernel fails. ``forward`` takes the Pallas path only when
the XLA device's hardware is a TPU, and ``_pallas_attention`` refuses anything else.
"""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from halserve.attention_backends.base import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:  # pragma: no cover
    import torch

_MASKED = -1e30  # finite: a fully masked (padded) row must not produce NaN


@functools.cache
def xla_device_kind() -> str | None:
    """Hardware of the default XLA device (``"TPU"``, ``"CPU"``, ``"GPU"``, ...), or None
    when torch_xla is not installed. Initialises the PJRT client on first call."""
    if importlib.util.find_spec("torch_xla") is None:
        return None
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    try:
        return str(xm.xla_device_hw(device)).upper()
    except Exception:  # noqa: BLE001 - older/newer API: ask the runtime for the real device
        real = torch_xla._XLAC._xla_real_devices([str(device)])[0]  # e.g. "TPU:0", "CPU:0"
        return real.split(":")[0].upper()


@dataclass
class XlaAttentionMetadata:
    """The (padded) common metadata plus per-token indices built on the host."""

    common: AttentionMetadata
    token_req: torch.Tensor  # [T_pad] int64: request row of each token (0 for padding)
    token_pos: torch.Tensor  # [T_pad] int64: position of each token in its sequence, -1 for padding
    num_seqs: torch.Tensor  # [1] int32: real number of requests (the Pallas kernel's num_seqs)


class XlaAttentionBackend(AttentionBackend):
    name = "xla"
    platforms = ("tpu",)
    dtypes = ("bfloat16", "float32")
    kv_cache_dtypes = ("auto",)
    supports_sliding_window = True
    supports_logits_soft_cap = True
    description = (
        "torch-xla: Pallas ragged_paged_attention on TPU; a static-shape masked torch fallback on other XLA "
        "devices; cache [blocks, block_size, 2 * kv_heads (k/v interleaved), head_size]"
    )

    @classmethod
    def _supports(cls, **_: Any) -> str | None:
        if importlib.util.find_spec("torch_xla") is None:
            return "torch_xla is not installed"
        return None

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, 2 * num_kv_heads, head_size)

    @classmethod
    def kv_cache_block_views(cls, kv_cache, block_size: int, num_kv_heads: int, head_size: int):
        pairs = kv_cache.unflatten(2, (num_kv_heads, 2))  # (2h is head h's key, 2h + 1 its value)
        return pairs[:, :, :, 0], pairs[:, :, :, 1]

    @classmethod
    def build_metadata(cls, common: AttentionMetadata) -> XlaAttentionMetadata:
        """Per-token request rows and positions, on the host, for the padded token count
        (``slot_mapping``'s length, which the runner pads along with q)."""
        import torch

        num_tokens_padded = common.slot_mapping.shape[0]
        qsl = common.query_start_loc_cpu.to(torch.int64)
        seq = common.seq_lens_cpu.to(torch.int64)
        num_reqs = common.num_reqs
        query_lens = qsl[1 : num_reqs + 1] - qsl[:num_reqs]  # [R]
        if int(qsl[num_reqs]) > num_tokens_padded:
            raise ValueError(
                f"query_start_loc ends at {int(qsl[num_reqs])} tokens but slot_mapping has {num_tokens_padded}"
            )
        if bool((query_lens > seq[:num_reqs]).any()):
            raise ValueError(f"query_lens {query_lens.tolist()} exceed seq_lens {seq[:num_reqs].tolist()}")
        req = torch.repeat_interleave(torch.arange(num_reqs), query_lens)  # [T]
        offset = torch.arange(req.shape[0]) - qsl[req]  # index within the request's new tokens
        pos = seq[req] - query_lens[req] + offset
        token_req = torch.zeros(num_tokens_padded, dtype=torch.int64)
        token_pos = torch.full((num_tokens_padded,), -1, dtype=torch.int64)
        token_req[: req.shape[0]] = req
        token_pos[: req.shape[0]] = pos
        device = common.seq_lens.device
        return XlaAttentionMetadata(
            common=common,
            token_req=token_req.to(device),
            token_pos=token_pos.to(device),
            num_seqs=torch.tensor([num_reqs], dtype=torch.int32).to(device),
        )

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None, kv_cache_dtype: str = "auto") -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, sliding_window, logits_soft_cap, kv_cache_dtype)
        if kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported by the xla backend; use 'auto'")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self._use_pallas: bool | None = None

    # -- forward ----------------------------------------------------------------------
    def forward(self, q, k, v, kv_cache, metadata: XlaAttentionMetadata, k_scale: float = 1.0, v_scale: float = 1.0):
        if not isinstance(metadata, XlaAttentionMetadata):
            raise ValueError(
                f"XlaAttentionBackend.forward needs the metadata from XlaAttentionBackend.build_metadata, "
                f"got {type(metadata).__name__}"
            )
        self._check(q, k, v, kv_cache, metadata)
        self.write_kv(k, v, kv_cache, metadata.common.slot_mapping)
        if self._use_pallas is None:
            self._use_pallas = q.device.type == "xla" and xla_device_kind() == "TPU"
        if self._use_pallas:
            return self._pallas_attention(q, kv_cache, metadata)
        return self._masked_attention(q, kv_cache, metadata)

    def _check(self, q, k, v, kv_cache, md: XlaAttentionMetadata) -> None:
        # Shapes only (static, free): values are never read in forward.
        t = q.shape[0]
        if q.dim() != 3 or q.shape[1:] != (self.num_heads, self.head_size):
            raise ValueError(f"q must be [T, num_heads={self.num_heads}, head_size={self.head_size}], got {tuple(q.shape)}")
        for name, x in (("k", k), ("v", v)):
            if x.shape != (t, self.num_kv_heads, self.head_size):
                raise ValueError(f"{name} must be [{t}, {self.num_kv_heads}, {self.head_size}], got {tuple(x.shape)}")
        want = (2 * self.num_kv_heads, self.head_size)
        if kv_cache.dim() != 4 or tuple(kv_cache.shape[2:]) != want:
            raise ValueError(
                f"xla kv_cache must be [num_blocks, block_size, 2 * num_kv_heads={want[0]}, head_size={want[1]}] "
                f"(XlaAttentionBackend.kv_cache_shape), got {tuple(kv_cache.shape)}"
            )
        if md.common.slot_mapping.shape[0] != t:
            raise ValueError(
                f"slot_mapping has {md.common.slot_mapping.shape[0]} entries for {t} (padded) tokens; pad the step "
                "with halserve.worker.xla_buckets.pad_step so every token has a slot"
            )

    def write_kv(self, k, v, kv_cache, slot_mapping) -> None:
        """Scatter the step's K/V (all T_pad tokens; padding lands in the null block)."""
        import torch

        t = k.shape[0]
        kv = torch.stack([k, v], dim=2).reshape(t, 2 * self.num_kv_heads, self.head_size)  # k0 v0 k1 v1 ...
        kv_cache.view(-1, 2 * self.num_kv_heads, self.head_size).index_copy_(0, slot_mapping, kv.to(kv_cache.dtype))

    def _masked_attention(self, q, kv_cache, md: XlaAttentionMetadata):
        """Dense masked attention over each token's request blocks; every shape is
        (T_pad, R_pad, max_blocks_per_req) derived, so one graph per bucket."""
        import torch

        t = q.shape[0]
        hk, group, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_size
        block_table = md.common.block_table  # [R_pad, MB] int32
        r_pad, mb = block_table.shape
        bs = kv_cache.shape[1]
        length = mb * bs
        pages = kv_cache.index_select(0, block_table.reshape(-1).to(torch.int64))  # [R_pad * MB, BS, 2Hk, D]
        pages = pages.view(r_pad, length, 2 * hk, d)
        keys = pages[:, :, 0::2].index_select(0, md.token_req).float()  # [T, L, Hk, D]
        values = pages[:, :, 1::2].index_select(0, md.token_req).float()
        qg = q.float().view(t, hk, group, d)
        scores = torch.einsum("tkgd,tlkd->tkgl", qg, keys) * self.scale  # [T, Hk, G, L]
        if self.logits_soft_cap:
            scores = torch.tanh(scores / self.logits_soft_cap) * self.logits_soft_cap
        key_pos = torch.arange(length, device=q.device).unsqueeze(0)  # [1, L]
        query_pos = md.token_pos.unsqueeze(1)  # [T, 1]; -1 for padding masks every key
        visible = key_pos <= query_pos
        if self.sliding_window is not None:
            visible = visible & (key_pos > query_pos - self.sliding_window)
        visible = visible[:, None, None, :]  # [T, 1, 1, L]
        scores = torch.where(visible, scores, torch.full_like(scores, _MASKED))
        probs = torch.softmax(scores, dim=-1) * visible  # padded rows -> all zeros
        out = torch.einsum("tkgl,tlkd->tkgd", probs, values)
        return out.reshape(t, self.num_heads, d).to(q.dtype)

    def _pallas_attention(self, q, kv_cache, md: XlaAttentionMetadata):
        if not (q.device.type == "xla" and xla_device_kind() == "TPU"):
            raise RuntimeError(
                f"the Pallas ragged_paged_attention kernel runs only on a TPU (tensors on {q.device}, XLA hardware "
                f"{xla_device_kind()}); on CPU tensors torch.ops.xla.ragged_paged_attention returns uninitialised memory"
            )
        from torch_xla.experimental.custom_kernel import ragged_paged_attention

        c = md.common
        return ragged_paged_attention(
            q, kv_cache, c.seq_lens, c.block_table, c.query_start_loc, md.num_seqs,
            sm_scale=self.scale, sliding_window=self.sliding_window, soft_cap=self.logits_soft_cap,
            use_kernel=True,
        )

"""What each layer keeps in the KV cache (its *spec*), and how layers are grouped over one block pool.

A model declares one spec per attention layer (``Attention.kv_cache_spec``); layers with equal
specs form groups of ``group_size`` layers, and every group gets its own block table per request
over the one shared ``BlockPool`` (vLLM's hybrid KV-cache manager). A block id therefore names
``group_size`` layers' worth of memory: slot j of block b is tensor j's block b, whichever group
holds b at the moment::

    Gemma 3 (5 sliding : 1 global), 12 layers -> group_size 2, 6 groups
    tensor 0:  layer 0 (g0: sliding) layer 2 (g1)  layer 4 (g2)  ... layer 5 (g5: full)
    tensor 1:  layer 1 (g0: sliding) layer 3 (g1)  ...               layer 11 (g5: full)
    block b of tensor j = K/V of the layer in slot j of whichever group owns b

Only the *full attention* group's blocks grow with the context; a sliding-window group keeps about
``window / block_size + 1`` blocks per request (``SingleTypeManager.remove_skipped_blocks``), so
long requests fit several times more often. A model with one spec has one group of all its layers:
exactly the single block table of before.

Recurrent layers (Mamba2, ``MambaSpec``) keep no per-position K/V but one fixed-size state per request
(conv window + SSM state). It lives in the same pages: a request's state takes the first
``num_state_blocks`` blocks of its group's table, allocated with the request and freed with it, whatever
its length::

    Bamba, 4 layers (mamba, attention, mamba, mamba) -> 4 groups of one layer (group_size 1)
    full group (layer 1):   [ blk 3 | blk 8 | blk 11 | ... ]     grows with the context
    mamba group (layer 0):  [ blk 5 | blk 6 ]                    conv + SSM state, fixed
    block b of the tensor = K/V of layer 1, or 1/2 of the state of layer 0, 2 or 3
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """Every position's K/V for the whole request."""

    kind: ClassVar[str] = "full_attention"
    is_recurrent: ClassVar[bool] = False  # (MambaSpec: a state per request, read by no attention backend)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no later query of the request will read (their wholly-covered blocks are freed)."""
        return 0

    def max_num_blocks(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        """Most blocks one request of ``num_tokens`` tokens holds at once (chunks of at most ``max_step_tokens``)."""
        return cdiv(num_tokens, block_size)


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec:
    """The last ``window`` positions: the query at position p reads keys ``p - window < j <= p``."""

    window: int
    kind: ClassVar[str] = "sliding_window"
    is_recurrent: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"a sliding window must be >= 1 token, got {self.window}")

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        # the next query sits at position num_computed_tokens; it reads from num_computed - window + 1
        return max(0, num_computed_tokens - self.window + 1)

    def max_num_blocks(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        # a step computing positions c .. c+n-1 (n <= max_step_tokens) reads from c - window + 1:
        # window - 1 + n positions, over at most one more block than they fill
        live = self.window - 1 + min(max_step_tokens, num_tokens)
        return min(cdiv(num_tokens, block_size), cdiv(live, block_size) + 1)


@dataclass(frozen=True, slots=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3): per position one compressed latent of
    ``kv_lora_rank`` values plus the rotary key of ``qk_rope_head_dim`` values, shared by every head
    (no per-head K/V). Blocks live like full attention's: every position, the whole request.

    One layer's page (one block of it)::

        slot 0: | latent c_kv [kv_lora_rank] | k_pe [qk_rope_head_dim] |
        slot 1: | ...                                                   |
        ...     block_size slots -> block_size * (kv_lora_rank + qk_rope_head_dim) elements

    DeepSeek-V3 (512 + 64) stores 576 values per token and layer where per-head K/V of its 128
    heads would take 2 * 128 * 192 = 49152: 85x less.
    """

    kv_lora_rank: int
    qk_rope_head_dim: int
    kind: ClassVar[str] = "mla"
    is_recurrent: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.kv_lora_rank < 1 or self.qk_rope_head_dim < 0 or self.qk_rope_head_dim % 2:
            raise ValueError(f"an MLA cache needs kv_lora_rank >= 1 and an even qk_rope_head_dim >= 0, got "
                             f"{self.kv_lora_rank} and {self.qk_rope_head_dim}; check the checkpoint's config.json")

    @property
    def entry_size(self) -> int:
        """Values per position and layer: the latent, then the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int]:
        """One layer's cache tensor: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]."""
        return (num_blocks, block_size, self.entry_size)

    def page_size_bytes(self, block_size: int, element_size: int) -> int:
        """Bytes of one block of one layer (``element_size``: the cache dtype's, 1 for fp8)."""
        return block_size * self.entry_size * element_size

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0

    def max_num_blocks(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        return cdiv(num_tokens, block_size)


@dataclass(frozen=True, slots=True)
class MambaSpec:
    """A Mamba2 layer's recurrent state: one per request, of a fixed size whatever the request's length.

    ``conv_state_shape`` [conv_dim, d_conv - 1] (the last inputs of the causal conv) and
    ``ssm_state_shape`` [num_heads, head_dim, d_state], in that order in the state's flat elements. The
    state is written into the pages of the attention layers it shares the pool with:
    ``page_token_elements`` is what one token of one such layer takes (2 * kv_heads * head_size, K and V),
    so a block holds ``block_size * page_token_elements`` state elements and a state needs::

        num_state_blocks = cdiv(conv + ssm elements, block_size * page_token_elements)

    (Bamba-9B: conv 8448 * 3 + SSM 128 * 64 * 128 = 1073920 elements over 16-token pages of 2 * 8 * 128
    per layer, 32768: 33 blocks per request and group; vLLM raises the attention block size instead so
    one page holds a state.)
    """

    conv_state_shape: tuple[int, int]
    ssm_state_shape: tuple[int, int, int]
    page_token_elements: int
    kind: ClassVar[str] = "mamba"
    is_recurrent: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.page_token_elements < 1 or min(self.conv_state_shape + self.ssm_state_shape) < 1:
            raise ValueError(f"a Mamba state needs positive sizes, got conv {self.conv_state_shape}, ssm "
                             f"{self.ssm_state_shape} over pages of {self.page_token_elements} elements per token")

    @property
    def num_state_elements(self) -> int:
        return math.prod(self.conv_state_shape) + math.prod(self.ssm_state_shape)

    def num_state_blocks(self, block_size: int) -> int:
        """Blocks one request's state takes (the first of its group's table)."""
        return cdiv(self.num_state_elements, block_size * self.page_token_elements)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0

    def max_num_blocks(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        return self.num_state_blocks(block_size)


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MLASpec | MambaSpec
SPEC_KINDS = ("full_attention", "sliding_window", "mla", "mamba")
"""The spec kinds halserve's KV-cache manager serves (``AttentionBackend.kv_cache_spec_kinds``)."""


def is_recurrent(spec: object) -> bool:
    """Whether layers of ``spec`` keep a recurrent state per request (``MambaSpec``): no attention backend
    reads it, no prefix cache can restore it (a plugin's spec class without ``is_recurrent``: no)."""
    return bool(getattr(spec, "is_recurrent", False))


def spec_for_window(sliding_window: int | None) -> KVCacheSpec:
    """The spec of an attention layer with this window (None: full attention)."""
    return FullAttentionSpec() if sliding_window is None else SlidingWindowSpec(sliding_window)


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers sharing a spec and one block table per request."""

    spec: KVCacheSpec
    layer_indices: tuple[int, ...]  # attention-layer indices (model order), slot j = layer_indices[j]


def group_layers(layer_specs: list[KVCacheSpec]) -> list[KVCacheGroup]:
    """Groups of equal-spec layers, all of one size (the tensors' count), in order of first layer, the
    recurrent groups last (group 0, the one the scheduler sees, grows with the context).

    One spec: one group of every layer (the single block table of a plain model). Several: the group
    size is the gcd of the specs' layer counts when that keeps groups few (<= 8), else the smallest
    count, the last group of a spec then holding fewer layers (its unused slots are memory left idle,
    as in vLLM's padding)."""
    if not layer_specs:
        raise ValueError("a model with no attention layers has no KV cache to group")
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for index, spec in enumerate(layer_specs):
        by_spec.setdefault(spec, []).append(index)
    if len(by_spec) == 1:
        return [KVCacheGroup(layer_specs[0], tuple(range(len(layer_specs))))]
    counts = [len(layers) for layers in by_spec.values()]
    size = math.gcd(*counts)
    if sum(count // size for count in counts) > 8:
        size = min(counts)
    groups = []
    for spec, layers in sorted(by_spec.items(), key=lambda item: is_recurrent(item[0])):
        for start in range(0, len(layers), size):
            groups.append(KVCacheGroup(spec, tuple(layers[start:start + size])))
    return groups


def group_size(groups: list[KVCacheGroup]) -> int:
    """Layers per block (the number of cache tensors)."""
    return max(len(group.layer_indices) for group in groups)

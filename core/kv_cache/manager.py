"""Per-request block tables on top of the block pool, with automatic prefix caching.

The scheduler asks, then changes:
    blocks, n = get_computed_blocks(req)          # longest cached prefix (no side effects)
    ids = allocate_slots(req, k, blocks)           # None: not enough free blocks, nothing changed
    ...
    free(req)                                      # finished or preempted

Block table of one request (block_size B = 4, 10 tokens computed after this step)::

    tokens:  t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .  .
    table:   [  blk 7    |   blk 2     |  blk 9   ]     slot of t5 = 2 * 4 + 1
             full, hashed  full, hashed  partial: not hashed yet

Hybrid models (``halserve.kv_cache.spec``): one table per KV-cache group over the one pool. A
sliding-window group's leading blocks that no later query reads are released while the request
runs; its table keeps the null block there, so positions still index it (window 4, B = 4)::

    computed 13, next query at 13 reads 10..13
    full group:     [ blk 7 | blk 2 | blk 9 | blk 4 ]
    sliding group:  [ null  | null  | blk 5 | blk 8 ]      blocks 0, 1 freed (9 < 10 - 1)

A recurrent group (``MambaSpec``) holds its request's state in the first ``num_state_blocks`` blocks
of its table from the first allocation to ``free``; its table never grows. Such a model runs without
prefix caching (a state is the whole prefix's, not a block's: no hit without state checkpoints).

The scheduler sees group 0 as before (``allocate_slots``' return value, ``get_block_ids``); the
other groups' tables go to the worker through ``new_group_block_ids`` / ``get_group_block_ids``.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from halserve.kv_cache.block import BlockId, KVCacheBlock
from halserve.kv_cache.block_pool import BlockPool
from halserve.kv_cache.hashing import extend_block_hashes
from halserve.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    group_layers,
    is_recurrent,
)

if TYPE_CHECKING:  # pragma: no cover
    from halserve.request import Request, RequestId

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


ComputedBlocks = Sequence[KVCacheBlock] | tuple[list[KVCacheBlock], ...]
"""A prefix hit: a list of blocks (one group), or one list per group (a hybrid model), equal lengths."""


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        layer_specs: Sequence[KVCacheSpec] = (),
    ) -> None:
        """``layer_specs``: each attention layer's spec (empty: every layer full attention, one group)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.groups: list[KVCacheGroup] = (group_layers(list(layer_specs)) if layer_specs
                                           else [KVCacheGroup(FullAttentionSpec(), (0,))])
        self.specs = [group.spec for group in self.groups]
        self.num_groups = len(self.groups)
        if is_recurrent(self.specs[0]):
            raise ValueError("a model whose every cached layer is recurrent has no attention pages to keep its "
                             "state in; it needs at least one attention layer")
        # recurrent groups: their state's block count (fixed per request); None for the growing groups
        self._num_state_blocks = [spec.num_state_blocks(block_size) if isinstance(spec, MambaSpec) else None
                                  for spec in self.specs]
        if enable_prefix_caching and any(is_recurrent(spec) for spec in self.specs):
            logger.info("prefix caching is off: this model's recurrent (Mamba) layers keep one state per request, "
                        "not per block, so a cached prefix could not restore it")
            enable_prefix_caching = False
        self.enable_prefix_caching = enable_prefix_caching
        # the only release of blocks while a request runs: sliding windows (full attention and MLA
        # latents keep every position)
        self._windowed = [g for g, spec in enumerate(self.specs) if isinstance(spec, SlidingWindowSpec)]
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.req_to_blocks: dict[RequestId, list[KVCacheBlock]] = {}  # group 0's tables
        # groups 1..: req -> one table per group (hybrid models only)
        self.req_to_group_blocks: dict[RequestId, list[list[KVCacheBlock]]] = {}
        # req -> per windowed group, how many leading blocks were released (null) already
        self._num_released: dict[RequestId, list[int]] = {}
        # How many leading blocks of each request have been through cache_full_blocks.
        self.num_cached_block: dict[RequestId, int] = {}
        # Groups 1..'s new block ids of the last successful allocate_slots (hybrid models; else []).
        self.new_group_block_ids: list[list[BlockId]] = []
        # Prefix-cache counters in tokens (like vLLM's metrics), counted once per admission.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- capacity ---------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def max_num_blocks(self, num_tokens: int, max_step_tokens: int) -> int:
        """Most blocks (all groups) one request of ``num_tokens`` tokens holds at once, computed in
        steps of at most ``max_step_tokens`` tokens (a sliding window holds only its window)."""
        return sum(spec.max_num_blocks(num_tokens, self.block_size, max_step_tokens) for spec in self.specs)

    def num_blocks_by_group(self) -> list[int]:
        """Distinct blocks each group's requests hold (a block shared by prefix hits counts once)."""
        counts = [len({b.block_id for blocks in self.req_to_blocks.values() for b in blocks if not b.is_null})]
        for g in range(1, self.num_groups):
            counts.append(len({b.block_id for tables in self.req_to_group_blocks.values()
                               for b in tables[g - 1] if not b.is_null}))
        return counts

    # -- prefix cache -----------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[ComputedBlocks, int]:
        """Longest cached prefix of ``request``'s full blocks and its length in tokens.

        Never the whole sequence: the last token must be fed to the model to get logits,
        so the hit is capped at ``num_tokens - 1`` tokens rounded down to a block boundary
        (for a new request num_tokens is the prompt; a resumed one also has outputs).
        A hybrid model's hit needs every group's blocks: a full-attention group its whole
        prefix, a sliding-window group the window before the hit's end (then one list per group).
        Side-effect free apart from extending ``request.block_hashes``.
        """
        if not self.enable_prefix_caching:
            return ([] if self.num_groups == 1 else ([],) * self.num_groups), 0
        max_hit_blocks = self.max_cache_hit_tokens(request) // self.block_size
        if not max_hit_blocks:
            return ([] if self.num_groups == 1 else ([],) * self.num_groups), 0
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                            extra_keys=request.block_hash_extra_keys)
        if self.num_groups == 1:
            hits = self._find_hit(0, request.block_hashes, max_hit_blocks)
            return hits, len(hits) * self.block_size
        # a hit every group can serve: shrink until all agree (a window's hit at a shorter length
        # needs other blocks, so each group is asked again at the new length)
        num_blocks = max_hit_blocks
        while True:
            per_group = [self._find_hit(g, request.block_hashes, num_blocks) for g in range(self.num_groups)]
            shortest = min(len(hit) for hit in per_group)
            if shortest == num_blocks:
                return tuple(per_group), num_blocks * self.block_size
            num_blocks = shortest

    def _find_hit(self, group: int, block_hashes: Sequence, max_blocks: int) -> list[KVCacheBlock]:
        """Group ``group``'s longest hit of at most ``max_blocks`` blocks: a full-attention group's
        cached prefix; a sliding window's last run of cached blocks covering a window (the null
        block before it), searched from the right, as vLLM's SlidingWindowManager."""
        pool = self.block_pool
        spec = self.specs[group]
        if not isinstance(spec, SlidingWindowSpec):  # every position: the cached prefix
            hits: list[KVCacheBlock] = []
            for block_hash in block_hashes[:max_blocks]:
                block = pool.get_cached_block(block_hash, group)
                if block is None:
                    break
                hits.append(block)
            return hits
        # the query after a hit of k blocks reads positions from k * B - window + 1: the last
        # cdiv(window - 1, B) blocks
        needed = cdiv(spec.window - 1, self.block_size)
        run: list[KVCacheBlock] = []
        for i in range(max_blocks - 1, -1, -1):
            block = pool.get_cached_block(block_hashes[i], group)
            if block is None:
                run = []
                continue
            run.append(block)
            if len(run) >= needed:
                return [pool.null_block] * i + run[::-1]
        return run[::-1]  # a run from block 0 shorter than a window: the whole prefix is in it

    def max_cache_hit_tokens(self, request: Request) -> int:
        """The longest prefix of ``request`` that may come from a cache (this one or a KV connector's):
        whole blocks, never its last token (fed to the model for its logits), and none for a request
        that needs every prompt position computed."""
        if getattr(request.sampling_params, "prompt_logprobs", None) is not None and not request.num_output_tokens:
            return 0  # its prompt logprobs need the logits of every prompt position
        pooling = getattr(request.sampling_params, "pooling", None)
        if pooling is not None and pooling.reads_whole_prompt:
            return 0  # MEAN/CLS embeddings pool the hidden states of every prompt position
        return (request.num_tokens - 1) // self.block_size * self.block_size

    # -- allocation -------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: ComputedBlocks = (),
        num_lookahead_tokens: int = 0,
    ) -> list[BlockId] | None:
        """Grow ``request``'s table to hold ``num_new_tokens`` more tokens after its
        ``num_computed_tokens`` plus the ``new_computed_blocks`` prefix hit (only on the
        first allocation of a request or of a resumed one).

        ``num_lookahead_tokens``: slots for that many speculative (draft) tokens after
        them, which are not the request's tokens yet: their blocks are neither hashed nor
        cached until the drafts are accepted and computed as real tokens.

        Returns the ids of the blocks appended to group 0's table (hits first; the other groups'
        in ``new_group_block_ids``), or None when the pool cannot supply them; then nothing
        changed but the release of blocks its sliding windows no longer read.

        Blocks that will be full once this step has run are hashed and registered *now*,
        so a request scheduled later in the same step can hit them: attention backends
        write all of a step's K/V before attending, so the hit is safe.
        """
        if self.num_groups > 1:
            return self._allocate_hybrid(request, num_new_tokens, new_computed_blocks, num_lookahead_tokens)
        assert num_new_tokens > 0, f"allocate_slots needs num_new_tokens > 0, got {num_new_tokens}"
        hit_blocks = cast("Sequence[KVCacheBlock]", new_computed_blocks)  # (one group: one list of blocks)
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id)
        is_first = req_blocks is None
        assert is_first or not hit_blocks, "prefix hits only on a request's first allocation"
        if self._windowed and req_blocks is not None:  # (a model whose every layer slides: one windowed group)
            self._release_skipped(request, 0, req_blocks)
        num_computed = request.num_computed_tokens + len(hit_blocks) * self.block_size
        num_total = num_computed + num_new_tokens
        assert num_total <= request.num_tokens + request.num_output_placeholders, (
            f"{req_id}: scheduling up to token {num_total} but only {request.num_tokens} exist"
        )
        num_known = min(num_total, request.num_tokens)  # (async scheduling: the last may be placeholders)
        assert self.max_model_len is None or num_total + num_lookahead_tokens <= self.max_model_len

        num_have = (0 if req_blocks is None else len(req_blocks)) + len(hit_blocks)
        num_new_blocks = max(0, cdiv(num_total + num_lookahead_tokens, self.block_size) - num_have)
        # Hits on free cached blocks take them out of the free queue too.
        num_revived = sum(1 for block in hit_blocks if block.ref_cnt == 0 and not block.is_null)
        if num_new_blocks + num_revived > self.block_pool.get_num_free_blocks():
            return None

        # -- commit --
        if req_blocks is None:  # (is_first)
            req_blocks = self.req_to_blocks[req_id] = []
            self.num_cached_block[req_id] = 0
            if self._windowed:
                self._num_released[req_id] = [_count_null(hit_blocks)]
            if self.enable_prefix_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(hit_blocks) * self.block_size
        self._touch(hit_blocks)
        req_blocks.extend(hit_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        assert new_blocks is not None
        req_blocks.extend(new_blocks)

        if self.enable_prefix_caching:
            num_full = num_known // self.block_size
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, num_known,
                                request.block_hash_extra_keys)
            self.block_pool.cache_full_blocks(req_blocks, request.block_hashes, self.num_cached_block[req_id], num_full)
            self.num_cached_block[req_id] = max(num_full, self.num_cached_block[req_id])

        return [block.block_id for block in (*hit_blocks, *new_blocks)]

    def _allocate_hybrid(self, request: Request, num_new_tokens: int, new_computed_blocks: ComputedBlocks,
                         num_lookahead_tokens: int) -> list[BlockId] | None:
        """``allocate_slots`` with one table per group (every group grows to the same length)."""
        assert num_new_tokens > 0, f"allocate_slots needs num_new_tokens > 0, got {num_new_tokens}"
        req_id = request.request_id
        bs = self.block_size
        hits = (cast("tuple[list[KVCacheBlock], ...]", tuple(new_computed_blocks)) if new_computed_blocks
                else cast("tuple[list[KVCacheBlock], ...]", ([],) * self.num_groups))
        assert len(hits) == self.num_groups and len({len(h) for h in hits}) == 1, "one hit list per group, equal lengths"
        tables = self._tables(req_id)
        is_first = tables is None
        assert is_first or not hits[0], "prefix hits only on a request's first allocation"
        if tables is not None:
            for g in self._windowed:
                self._release_skipped(request, g, tables[g])
        num_hit = len(hits[0])
        num_computed = request.num_computed_tokens + num_hit * bs
        num_total = num_computed + num_new_tokens
        assert num_total <= request.num_tokens + request.num_output_placeholders, (
            f"{req_id}: scheduling up to token {num_total} but only {request.num_tokens} exist"
        )
        num_known = min(num_total, request.num_tokens)
        assert self.max_model_len is None or num_total + num_lookahead_tokens <= self.max_model_len
        # every growing group to the same length; a recurrent one to its state's blocks (the first time)
        num_wanted = cdiv(num_total + num_lookahead_tokens, bs)
        num_new_blocks = [max(0, (num_wanted if fixed is None else fixed)
                              - (0 if tables is None else len(tables[g])) - len(hits[g]))
                          for g, fixed in enumerate(self._num_state_blocks)]
        num_revived = sum(1 for hit in hits for block in hit if block.ref_cnt == 0 and not block.is_null)
        # (a block hit in two groups cannot happen: each group registers under its own key)
        if sum(num_new_blocks) + num_revived > self.block_pool.get_num_free_blocks():
            return None

        # -- commit --
        if tables is None:
            tables = [[] for _ in range(self.num_groups)]
            self.req_to_blocks[req_id] = tables[0]
            self.req_to_group_blocks[req_id] = tables[1:]
            self.num_cached_block[req_id] = 0
            self._num_released[req_id] = [_count_null(hits[g]) for g in self._windowed]
            if self.enable_prefix_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_hit * bs
        for g in range(self.num_groups):  # (every hit out of the free queue before any block is popped from it)
            self._touch(hits[g])
            tables[g].extend(hits[g])
        new_ids: list[list[BlockId]] = []
        for g in range(self.num_groups):
            new_blocks = self.block_pool.get_new_blocks(num_new_blocks[g])
            assert new_blocks is not None
            tables[g].extend(new_blocks)
            new_ids.append([block.block_id for block in (*hits[g], *new_blocks)])
        if self.enable_prefix_caching:
            num_full = num_known // bs
            extend_block_hashes(request.block_hashes, request.all_token_ids, bs, num_known,
                                request.block_hash_extra_keys)
            num_cached = self.num_cached_block[req_id]
            for g in range(self.num_groups):
                self.block_pool.cache_full_blocks(tables[g], request.block_hashes, num_cached, num_full, group=g)
            self.num_cached_block[req_id] = max(num_full, num_cached)
        self.new_group_block_ids = new_ids[1:]
        return new_ids[0]

    def _tables(self, req_id: RequestId) -> list[list[KVCacheBlock]] | None:
        first = self.req_to_blocks.get(req_id)
        return None if first is None else [first, *self.req_to_group_blocks[req_id]]

    def _touch(self, hits: Sequence[KVCacheBlock]) -> None:
        if hits:
            self.block_pool.touch(block for block in hits if not block.is_null)

    def _release_skipped(self, request: Request, group: int, table: list[KVCacheBlock]) -> None:
        """Give back group ``group``'s blocks wholly before the window of ``request``'s next query
        (their entries become the null block; freed cached blocks stay prefix hits until evicted)."""
        spec = self.specs[group]
        num_skipped = min(spec.num_skipped_tokens(request.num_computed_tokens) // self.block_size, len(table))
        released = self._num_released[request.request_id]
        slot = self._windowed.index(group) if self.num_groups > 1 else 0
        start = released[slot]
        if num_skipped <= start:
            return
        blocks = [block for block in table[start:num_skipped] if not block.is_null]
        null = self.block_pool.null_block
        for i in range(start, num_skipped):
            table[i] = null
        released[slot] = num_skipped
        self.block_pool.free_blocks(reversed(blocks))  # (the earliest last: it is evicted last)

    def free(self, request: Request) -> None:
        """Release the request's blocks (finished or preempted). Tail blocks go to the
        free queue first, so they are evicted first: a later request sharing the prefix
        is likelier to need the head. Unknown requests are ignored (never allocated)."""
        req_id = request.request_id
        req_blocks = self.req_to_blocks.pop(req_id, None)
        self.num_cached_block.pop(req_id, None)
        tables = [req_blocks] if req_blocks else []
        if self.num_groups > 1:
            tables += self.req_to_group_blocks.pop(req_id, [])
        if self._windowed:
            self._num_released.pop(req_id, None)
            tables = [[block for block in table if not block.is_null] for table in tables]
        for table in tables:
            self.block_pool.free_blocks(reversed(table))

    def get_block_ids(self, request_id: RequestId) -> list[BlockId]:
        """Group 0's table (a plain model's only one); released window blocks read as the null block 0."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def get_group_block_ids(self, request_id: RequestId) -> list[list[BlockId]]:
        """Groups 1..'s tables of a hybrid model ([] for a plain model or an unknown request)."""
        return [[block.block_id for block in table] for table in self.req_to_group_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()


def _count_null(blocks: Sequence[KVCacheBlock]) -> int:
    """Leading null entries of a sliding window's prefix hit (blocks before its window)."""
    n = 0
    for block in blocks:
        if not block.is_null:
            break
        n += 1
    return n

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
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from halserve.kv_cache.block import BlockId, KVCacheBlock
from halserve.kv_cache.block_pool import BlockPool
from halserve.kv_cache.hashing import extend_block_hashes

if TYPE_CHECKING:  # pragma: no cover
    from halserve.request import Request, RequestId


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.req_to_blocks: dict[RequestId, list[KVCacheBlock]] = {}
        # How many leading blocks of each request have been through cache_full_blocks.
        self.num_cached_block: dict[RequestId, int] = {}
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

    # -- prefix cache -----------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of ``request``'s full blocks and its length in tokens.

        Never the whole sequence: the last token must be fed to the model to get logits,
        so the hit is capped at ``num_tokens - 1`` tokens rounded down to a block boundary
        (for a new request num_tokens is the prompt; a resumed one also has outputs).
        Side-effect free apart from extending ``request.block_hashes``.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_hit_blocks = self.max_cache_hit_tokens(request) // self.block_size
        if not max_hit_blocks:
            return [], 0
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                            extra_keys=request.block_hash_extra_keys)
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

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
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[BlockId] | None:
        """Grow ``request``'s table to hold ``num_new_tokens`` more tokens after its
        ``num_computed_tokens`` plus the ``new_computed_blocks`` prefix hit (only on the
        first allocation of a request or of a resumed one).

        ``num_lookahead_tokens``: slots for that many speculative (draft) tokens after
        them, which are not the request's tokens yet: their blocks are neither hashed nor
        cached until the drafts are accepted and computed as real tokens.

        Returns the ids of the blocks appended to the table (hits first), or None when the
        pool cannot supply them; then nothing changed.

        Blocks that will be full once this step has run are hashed and registered *now*,
        so a request scheduled later in the same step can hit them: attention backends
        write all of a step's K/V before attending, so the hit is safe.
        """
        assert num_new_tokens > 0, f"allocate_slots needs num_new_tokens > 0, got {num_new_tokens}"
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id)
        is_first = req_blocks is None
        assert is_first or not new_computed_blocks, "prefix hits only on a request's first allocation"
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_total = num_computed + num_new_tokens
        assert num_total <= request.num_tokens + request.num_output_placeholders, (
            f"{req_id}: scheduling up to token {num_total} but only {request.num_tokens} exist"
        )
        num_known = min(num_total, request.num_tokens)  # (async scheduling: the last may be placeholders)
        assert self.max_model_len is None or num_total + num_lookahead_tokens <= self.max_model_len

        num_have = (0 if req_blocks is None else len(req_blocks)) + len(new_computed_blocks)
        num_new_blocks = max(0, cdiv(num_total + num_lookahead_tokens, self.block_size) - num_have)
        # Hits on free cached blocks take them out of the free queue too.
        num_revived = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks + num_revived > self.block_pool.get_num_free_blocks():
            return None

        # -- commit --
        if req_blocks is None:  # (is_first)
            req_blocks = self.req_to_blocks[req_id] = []
            self.num_cached_block[req_id] = 0
            if self.enable_prefix_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(new_computed_blocks) * self.block_size
        self.block_pool.touch(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        assert new_blocks is not None
        req_blocks.extend(new_blocks)

        if self.enable_prefix_caching:
            num_full = num_known // self.block_size
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, num_known,
                                request.block_hash_extra_keys)
            self.block_pool.cache_full_blocks(req_blocks, request.block_hashes, self.num_cached_block[req_id], num_full)
            self.num_cached_block[req_id] = max(num_full, self.num_cached_block[req_id])

        return [block.block_id for block in (*new_computed_blocks, *new_blocks)]

    def free(self, request: Request) -> None:
        """Release the request's blocks (finished or preempted). Tail blocks go to the
        free queue first, so they are evicted first: a later request sharing the prefix
        is likelier to need the head. Unknown requests are ignored (never allocated)."""
        req_blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if req_blocks:
            self.block_pool.free_blocks(reversed(req_blocks))

    def get_block_ids(self, request_id: RequestId) -> list[BlockId]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

"""KVCacheManager: block tables, prefix caching, ask-then-change allocation."""
import pytest

from halserve.kv_cache import KVCacheManager
from halserve.request import Request
from halserve.sampling_params import SamplingParams

BS = 4


def make_request(req_id, prompt, max_tokens=8):
    return Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=SamplingParams(), max_tokens=max_tokens)


def admit(mgr, req, budget=None):
    """What the scheduler does for a waiting request; returns the new block ids."""
    blocks, num_computed = mgr.get_computed_blocks(req)
    num_new = req.num_tokens - num_computed if budget is None else min(budget, req.num_tokens - num_computed)
    new_ids = mgr.allocate_slots(req, num_new, blocks)
    if new_ids is not None:
        req.num_computed_tokens = num_computed
        if req.num_cached_tokens is None:
            req.num_cached_tokens = num_computed
    return new_ids, num_new


def test_allocate_grows_table_and_free_returns_blocks():
    mgr = KVCacheManager(num_blocks=10, block_size=BS, max_model_len=64)
    req = make_request("a", range(10))
    new_ids, n = admit(mgr, req)
    assert n == 10 and len(new_ids) == 3 and 0 not in new_ids
    assert mgr.get_block_ids("a") == new_ids
    req.num_computed_tokens += n
    req.append_output_token_id(99)
    # Tokens 10 and 11 fit the third block; token 12 needs a fourth.
    assert mgr.allocate_slots(req, 1) == []
    req.num_computed_tokens += 1
    req.append_output_token_id(98)
    assert mgr.allocate_slots(req, 1) == []
    req.num_computed_tokens += 1
    req.append_output_token_id(97)
    (fourth,) = mgr.allocate_slots(req, 1)
    assert mgr.get_block_ids("a") == new_ids + [fourth]
    assert mgr.usage == pytest.approx(4 / 9)
    mgr.free(req)
    assert mgr.usage == 0.0 and mgr.get_block_ids("a") == []


def test_failed_allocation_changes_nothing():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable
    a = make_request("a", range(8))
    admit(mgr, a)
    free_before = mgr.get_num_free_blocks()
    queue_before = [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]
    b = make_request("b", range(100, 112))  # 3 blocks, only 1 free
    assert admit(mgr, b) == (None, 12)
    assert mgr.get_num_free_blocks() == free_before
    assert [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()] == queue_before
    assert "b" not in mgr.req_to_blocks
    assert mgr.prefix_cache_queries == 8  # only the admitted request was counted


def test_prefix_hit_across_requests_after_free():
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", range(13))  # 3 full blocks + 1 token
    a_ids, _ = admit(mgr, a)
    a.num_computed_tokens = 13
    mgr.free(a)
    b = make_request("b", [*range(12), 500, 501])  # shares the 3 full blocks
    blocks, num_computed = mgr.get_computed_blocks(b)
    assert num_computed == 12 and [x.block_id for x in blocks] == a_ids[:3]
    b_ids, n = admit(mgr, b)
    assert n == 2 and b_ids[:3] == a_ids[:3] and len(b_ids) == 4
    assert b.num_cached_tokens == 12
    assert mgr.prefix_cache_queries == 13 + 14 and mgr.prefix_cache_hits == 12


def test_hit_never_covers_the_whole_prompt():
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", range(8))
    admit(mgr, a)
    b = make_request("b", range(8))  # identical, block-aligned prompt
    blocks, num_computed = mgr.get_computed_blocks(b)
    assert num_computed == 4  # last block recomputed so the model yields logits
    _, n = admit(mgr, b)
    assert n == 4


def test_same_step_hit_on_blocks_cached_at_allocation():
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", range(10))
    a_ids, _ = admit(mgr, a)  # nothing computed yet: blocks are only scheduled
    b = make_request("b", range(10))
    b_ids, n = admit(mgr, b)
    assert b_ids[:2] == a_ids[:2] and n == 2
    assert [blk.ref_cnt for blk in mgr.req_to_blocks["b"][:2]] == [2, 2]


def test_chunked_prefill_caches_blocks_as_they_fill():
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", range(12))
    admit(mgr, a, budget=6)  # chunk of 6: 1 full block + half a block
    assert len(mgr.block_pool.cached_block_hash_to_block) == 1
    a.num_computed_tokens = 6
    mgr.allocate_slots(a, 6)
    assert len(mgr.block_pool.cached_block_hash_to_block) == 3
    assert list(mgr.block_pool.cached_block_hash_to_block) == a.block_hashes
    assert [mgr.block_pool.get_cached_block(h).block_id for h in a.block_hashes] == mgr.get_block_ids("a")


def test_hit_on_free_cached_blocks_counts_against_free_space():
    mgr = KVCacheManager(num_blocks=5, block_size=BS)  # 4 usable
    a = make_request("a", range(9))
    admit(mgr, a)  # 3 blocks; 2 full ones cached
    a.num_computed_tokens = 9
    mgr.free(a)
    assert mgr.get_num_free_blocks() == 4
    # b hits 2 free cached blocks and needs 3 more: 5 > 4 free -> refused, untouched.
    b = make_request("b", [*range(8), *range(100, 109)])
    blocks, num_computed = mgr.get_computed_blocks(b)
    assert num_computed == 8
    assert mgr.allocate_slots(b, 9, blocks) is None
    assert mgr.get_num_free_blocks() == 4 and all(x.ref_cnt == 0 for x in blocks)


def test_eviction_prefers_the_freed_request_tail():
    mgr = KVCacheManager(num_blocks=5, block_size=BS)  # 4 usable
    a = make_request("a", range(13))  # 4 blocks, 3 full & cached
    admit(mgr, a)
    a.num_computed_tokens = 13
    mgr.free(a)
    c = make_request("c", range(200, 203))  # needs one block: evicts a's last (uncached) block
    admit(mgr, c)
    blocks, _ = mgr.get_computed_blocks(make_request("x", range(13)))
    assert len(blocks) == 3  # a's full-block prefix still cached
    e = make_request("e", range(300, 303))
    admit(mgr, e)  # evicts a's third block (its hash goes)
    blocks, _ = mgr.get_computed_blocks(make_request("y", range(13)))
    assert len(blocks) == 2


def test_prefix_caching_disabled():
    mgr = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    a = make_request("a", range(12))
    admit(mgr, a)
    b = make_request("b", range(12))
    assert mgr.get_computed_blocks(b) == ([], 0)
    assert mgr.block_pool.cached_block_hash_to_block == {} and a.block_hashes == []
    assert mgr.prefix_cache_queries == 0 and mgr.prefix_cache_hits == 0


def test_usage_back_to_zero_with_shared_blocks():
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    reqs = [make_request(str(i), [*range(8), i]) for i in range(3)]
    for r in reqs:
        admit(mgr, r)
    assert mgr.usage > 0
    for r in reqs:
        mgr.free(r)
    assert mgr.usage == 0.0
    assert mgr.reset_prefix_cache() is True

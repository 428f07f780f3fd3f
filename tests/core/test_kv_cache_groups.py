"""KV-cache specs and groups (halserve.kv_cache.spec) and the manager's per-group tables: sliding
windows release their blocks while a request runs, prefix hits need a window's blocks, per-group
usage, and the scheduler admitting more long requests than with full-length tables."""
import random

import pytest
from scheduler_helpers import run_to_completion

from halserve.kv_cache import FullAttentionSpec, KVCacheManager, SlidingWindowSpec, group_layers
from halserve.kv_cache.spec import group_size
from halserve.request import Request
from halserve.sampling_params import SamplingParams
from halserve.scheduler import Scheduler, SchedulerConfig
from halserve.scheduler_output import ModelRunnerOutput

BS = 4
FULL, SW8 = FullAttentionSpec(), SlidingWindowSpec(8)


def make_request(req_id, prompt, max_tokens=64):
    return Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=SamplingParams(),
                   max_tokens=max_tokens)


def test_groups_of_equal_size():
    assert [g.layer_indices for g in group_layers([FULL] * 4)] == [(0, 1, 2, 3)]
    # Gemma 2: alternating -> two groups of 2
    groups = group_layers([SW8, FULL, SW8, FULL])
    assert [(g.spec, g.layer_indices) for g in groups] == [(SW8, (0, 2)), (FULL, (1, 3))]
    # Gemma 3: 5 sliding : 1 full, 12 layers -> 6 groups of 2
    specs = [FULL if (i + 1) % 6 == 0 else SW8 for i in range(12)]
    groups = group_layers(specs)
    assert group_size(groups) == 2 and len(groups) == 6
    assert sorted(i for g in groups for i in g.layer_indices) == list(range(12))
    assert all(g.spec == specs[g.layer_indices[0]] for g in groups for _ in g.layer_indices)
    # 62 layers (Gemma 3 27B: 52 sliding, 10 full): gcd 2 would be 31 groups; the smallest count (10) instead
    specs = [FULL if (i + 1) % 6 == 0 else SW8 for i in range(62)]
    groups = group_layers(specs)
    assert group_size(groups) == 10 and len(groups) == 7 and len(groups[-2].layer_indices) == 2
    with pytest.raises(ValueError, match="sliding window must be >= 1"):
        SlidingWindowSpec(0)


def step(mgr, req, n):
    """Schedule n tokens of req (computed after the call), as the scheduler does."""
    ids = mgr.allocate_slots(req, n)
    assert ids is not None
    req.num_computed_tokens += n
    while req.num_computed_tokens >= req.num_tokens:
        req.append_output_token_id(7)
    return ids


def test_sliding_window_blocks_are_released_while_the_request_runs():
    mgr = KVCacheManager(num_blocks=64, block_size=BS, layer_specs=[SW8, FULL])
    req = make_request("a", range(100, 140))  # 40 prompt tokens
    blocks, n = mgr.get_computed_blocks(req)
    assert n == 0
    assert mgr.allocate_slots(req, 16, blocks) is not None  # chunk 1: 4 blocks per group
    req.num_computed_tokens = 16
    assert mgr.get_num_free_blocks() == 63 - 8
    # chunk 2: its first query (16) reads from 16 - 8 + 1 = 9, so blocks 0 and 1 (positions 0..7) are released
    step(mgr, req, 16)
    assert mgr.get_num_free_blocks() == 63 - 16 + 2
    # group 0 is the sliding layer's (groups follow the first layer of each spec), group 1 the full one's
    sliding, (full,) = mgr.get_block_ids("a"), mgr.get_group_block_ids("a")
    assert sliding[:2] == [0, 0] and 0 not in sliding[2:] and 0 not in full and len(full) == len(sliding) == 8
    step(mgr, req, 8)  # the prompt is done at 40
    held = []
    for _ in range(40):  # decode: the full group grows a block every 4 tokens, the window's stays small
        step(mgr, req, 1)
        held.append(63 - mgr.get_num_free_blocks())
    sliding = mgr.get_block_ids("a")
    num_live = sum(1 for b in sliding if b)
    # the last step computed position 79, reading 72..79: blocks 18 and 19 of 20
    assert len(sliding) == 20 and num_live == 2 and sliding[:18] == [0] * 18
    assert mgr.num_blocks_by_group() == [2, 20]  # a hand count of each group's blocks
    assert held[-1] == 20 + 2  # memory held: the full table plus a window, not two full tables
    usage = [n / 63 for n in mgr.num_blocks_by_group()]
    assert sum(usage) == pytest.approx(mgr.usage)
    mgr.free(req)
    assert mgr.get_num_free_blocks() == 63 and mgr.usage == 0.0


def test_one_group_all_sliding_releases_too():
    mgr = KVCacheManager(num_blocks=32, block_size=BS, layer_specs=[SW8, SW8, SW8])
    assert mgr.num_groups == 1
    req = make_request("a", range(10, 30))
    mgr.allocate_slots(req, 20)
    req.num_computed_tokens = 20
    req.append_output_token_id(5)
    held = []
    for _ in range(30):
        step(mgr, req, 1)
        held.append(31 - mgr.get_num_free_blocks())
    # the next query's window (8 positions) spans at most 3 blocks, plus the block being filled
    assert max(held) <= 4 and held[-1] < 50 // 4
    assert mgr.get_block_ids("a")[0] == 0  # released entries read as the null block
    mgr.free(req)
    assert mgr.get_num_free_blocks() == 31


def test_prefix_hit_needs_the_window_blocks():
    mgr = KVCacheManager(num_blocks=64, block_size=BS, layer_specs=[SW8, FULL])
    prompt = list(range(200, 240))
    a = make_request("a", prompt)
    mgr.allocate_slots(a, 40)
    a.num_computed_tokens = 40
    mgr.free(a)  # every block stays cached
    b = make_request("b", prompt + [1, 2, 3])
    (sliding_hit, full_hit), n = mgr.get_computed_blocks(b)
    assert n == 40 and len(full_hit) == len(sliding_hit) == 10
    # the query at 40 reads positions 33..39: the last cdiv(7, 4) = 2 blocks; null before them
    assert [blk.is_null for blk in sliding_hit] == [True] * 8 + [False] * 2
    assert mgr.allocate_slots(b, 3, (sliding_hit, full_hit)) is not None
    assert mgr.prefix_cache_hits == 40
    assert mgr.get_num_free_blocks() == 63 - 12 - 2  # the hit revived 10 + 2 cached blocks; one new per group
    mgr.free(b)

    # the sliding group's last window block evicted: the hit shrinks to where a whole window is cached
    mgr.block_pool.uncache(sliding_hit[9])
    c = make_request("c", prompt + [9])
    (sliding_hit, full_hit), n = mgr.get_computed_blocks(c)
    assert n == 36 and len(full_hit) == 9 and [blk.is_null for blk in sliding_hit] == [True] * 7 + [False] * 2


def test_failed_hybrid_allocation_changes_nothing():
    mgr = KVCacheManager(num_blocks=8, block_size=BS, layer_specs=[SW8, FULL])  # 7 usable
    a = make_request("a", range(12))
    assert mgr.allocate_slots(a, 12) is not None  # 3 blocks per group: 6
    b = make_request("b", range(100, 104))
    free = mgr.get_num_free_blocks()
    assert mgr.allocate_slots(b, 4) is None  # needs 2 (one per group), 1 free
    assert mgr.get_num_free_blocks() == free and "b" not in mgr.req_to_blocks


class WindowedFakeWorker:
    """The checking fake worker of test_scheduler, with a block table per KV-cache group: every group
    writes each computed token at its own slot, and each query checks the positions its group reads
    (the whole context for full attention, the last ``window`` for a sliding window) hold the right
    tokens, so a released block that was still needed, or a wrong prefix hit, fails loudly."""

    def __init__(self, specs):
        self.specs = specs
        self.reqs: dict[str, tuple[list, list[list[int]], list[int]]] = {}  # tokens, tables, [num_computed]
        self.kv: dict[int, int] = {}

    def execute(self, so):
        for req_id in so.finished_req_ids:
            self.reqs.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            tables = [list(new.block_ids), *([list(t) for t in new.group_block_ids or []])]
            self.reqs[new.req_id] = ([*new.prompt_token_ids, *new.output_token_ids], tables, [new.num_computed_tokens])
        for cached in so.scheduled_cached_reqs:
            tokens, tables, computed = self.reqs[cached.req_id]
            assert computed[0] == cached.num_computed_tokens
            tables[0] += cached.new_block_ids
            for table, ids in zip(tables[1:], cached.new_group_block_ids or []):
                table += ids

        def slot(table, pos):
            return table[pos // BS] * BS + pos % BS

        for req_id, n in so.num_scheduled_tokens.items():
            tokens, tables, computed = self.reqs[req_id]
            for table in tables:
                for pos in range(computed[0], computed[0] + n):
                    assert table[pos // BS] != 0, f"{req_id} writes position {pos} into the null block"
                    self.kv[slot(table, pos)] = tokens[pos]
        req_ids, sampled = [], []
        for req_id, n in so.num_scheduled_tokens.items():
            tokens, tables, computed = self.reqs[req_id]
            first, computed[0] = computed[0], computed[0] + n
            for spec, table in zip(self.specs, tables):
                start = 0 if isinstance(spec, FullAttentionSpec) else max(0, first - spec.window + 1)
                got = [self.kv.get(slot(table, pos)) for pos in range(start, computed[0])]
                assert got == tokens[start:computed[0]], f"{req_id} would attend to wrong K/V ({spec})"
            req_ids.append(req_id)
            if computed[0] == len(tokens):
                tokens.append(1000 + (sum(tokens) * 31 + len(tokens)) % 997)
                sampled.append([tokens[-1]])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids))


def run_workload(layer_specs, num_blocks, seed=0, max_num_batched_tokens=16, num_requests=10, max_num_seqs=8,
                 uniform=False):
    """Random requests (``uniform``: 60 prompt + 60 output tokens each) to the end; returns (outputs,
    scheduler, most requests decoding at once)."""
    rng = random.Random(seed)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=256, block_size=BS, num_blocks=num_blocks,
                                      kv_cache_specs=tuple(layer_specs)))
    worker = WindowedFakeWorker(sched.kv_cache_manager.specs)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    for i in range(num_requests):
        if uniform:
            prompt, max_tokens = [rng.randrange(3, 500) for _ in range(60)], 60
        else:
            prompt = (shared[: rng.choice([0, 20, 40])] + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 60))])
            max_tokens = rng.randrange(20, 80)
        sched.add_request(make_request(f"r{i}", prompt, max_tokens=max_tokens))
    max_decoding = 0

    def one_step(s, w):
        nonlocal max_decoding
        so = s.schedule()
        max_decoding = max(max_decoding, sum(1 for r in s.running if r.num_computed_tokens >= r.num_prompt_tokens))
        return so, s.update_from_output(so, w.execute(so))

    results, _ = run_to_completion(sched, worker, one_step, max_steps=3000)
    assert sched.kv_cache_usage == 0.0
    return results, sched, max_decoding


@pytest.mark.parametrize("specs,num_blocks", [([SW8, FULL], 80), ([SW8, SW8, SW8, FULL], 80),
                                              ([SlidingWindowSpec(6)] * 2, 16), ([SlidingWindowSpec(5), FULL, SW8], 80)],
                         ids=["1to1", "3to1", "all_sliding", "two_windows"])
def test_hybrid_scheduling_attends_to_the_right_tokens(specs, num_blocks):
    """Chunked prefill, shared prefixes (hits) and a tight pool (preemption): every group's window holds
    the right tokens at every step, and the outputs are those of a roomy full-attention run."""
    reference, _, _ = run_workload([FULL], num_blocks=2000)
    tight, sched, _ = run_workload(specs, num_blocks=num_blocks)
    assert tight == reference
    assert sched.num_preemptions > 0 and sched.prefix_cache_hits > 0


def test_more_long_requests_run_at_once_with_windows():
    """The same memory (4 layers x 400 blocks of one layer): full attention holds 100 four-layer blocks,
    Gemma-3-style 3 sliding : 1 full holds 400 one-layer blocks, of which a request's windows take few.
    12 requests of 60 + 60 tokens: a decoding one holds 15..30 blocks with full attention only (at most
    6 fit), 15..30 + 3 windows (<= 3 blocks each) with the windows released (all 12 fit)."""
    kwargs = dict(num_requests=12, max_num_seqs=16, uniform=True, seed=1)
    _, _, full_decoding = run_workload([FULL] * 4, num_blocks=101, **kwargs)
    _, _, hybrid_decoding = run_workload([SW8, SW8, SW8, FULL], num_blocks=401, **kwargs)
    assert full_decoding <= 6 and hybrid_decoding >= 2 * full_decoding, (hybrid_decoding, full_decoding)

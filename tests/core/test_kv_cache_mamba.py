"""Recurrent-state groups (``MambaSpec``) in the KV-cache manager: a fixed number of blocks per request
from its first allocation to ``free``, whatever its length; recurrent groups after the growing ones;
admission counts them; prefix caching is switched off with a log line."""
import logging

import pytest

from halserve.kv_cache import FullAttentionSpec, KVCacheManager, group_layers
from halserve.kv_cache.spec import MambaSpec, cdiv, is_recurrent
from halserve.request import Request
from halserve.sampling_params import SamplingParams

BS = 4
FULL = FullAttentionSpec()
# conv [40, 3] + ssm [2, 8, 4] = 184 elements over 4-token pages of 16 elements per token (64): 3 blocks
MAMBA = MambaSpec((40, 3), (2, 8, 4), 16)


def make_request(req_id, prompt, max_tokens=64):
    return Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=SamplingParams(),
                   max_tokens=max_tokens)


def test_spec_sizes_and_grouping():
    assert MAMBA.num_state_elements == 184 and MAMBA.num_state_blocks(BS) == 3
    assert MAMBA.max_num_blocks(10_000, BS, 256) == 3 and MAMBA.num_skipped_tokens(500) == 0
    assert MambaSpec((40, 3), (2, 8, 4), 16).num_state_blocks(16) == 1
    assert is_recurrent(MAMBA) and not is_recurrent(FULL)
    # Bamba-like: mamba, attention, mamba, mamba -> the attention group first (the scheduler's group 0)
    groups = group_layers([MAMBA, FULL, MAMBA, MAMBA])
    assert [(g.spec, g.layer_indices) for g in groups] == [(FULL, (1,)), (MAMBA, (0,)), (MAMBA, (2,)), (MAMBA, (3,))]
    with pytest.raises(ValueError, match="positive sizes"):
        MambaSpec((40, 0), (2, 8, 4), 16)


def test_state_blocks_live_with_the_request(caplog):
    with caplog.at_level(logging.INFO, logger="halserve.kv_cache.manager"):
        mgr = KVCacheManager(num_blocks=40, block_size=BS, layer_specs=[MAMBA, FULL, MAMBA])
    assert not mgr.enable_prefix_caching
    assert "prefix caching is off" in caplog.text
    assert mgr.max_num_blocks(30, 16) == cdiv(30, BS) + 2 * 3
    free = mgr.get_num_free_blocks()
    req = make_request("a", range(100, 118))  # 18 prompt tokens
    blocks, n = mgr.get_computed_blocks(req)
    assert n == 0
    assert mgr.allocate_slots(req, 8, blocks) is not None  # chunk 1: 2 attention blocks, 3 per state
    assert mgr.num_blocks_by_group() == [2, 3, 3]
    assert [len(t) for t in mgr.get_group_block_ids("a")] == [3, 3]
    first_state_ids = mgr.get_group_block_ids("a")
    req.num_computed_tokens = 8
    assert mgr.allocate_slots(req, 10) is not None  # chunk 2: only the attention table grows
    req.num_computed_tokens = 18
    assert mgr.num_blocks_by_group() == [5, 3, 3]
    assert mgr.get_group_block_ids("a") == first_state_ids  # the same state blocks, chunk after chunk
    assert mgr.new_group_block_ids == [[], []]
    assert free - mgr.get_num_free_blocks() == 11
    assert mgr.usage == pytest.approx(11 / mgr.num_usable_blocks)
    # a second request that does not fit leaves everything as it was
    big = make_request("b", range(200, 300))
    assert mgr.allocate_slots(big, 100) is None
    assert mgr.num_blocks_by_group() == [5, 3, 3] and mgr.get_group_block_ids("b") == []
    mgr.free(req)  # finished, preempted or aborted: its state goes back too
    assert mgr.get_num_free_blocks() == free and mgr.num_blocks_by_group() == [0, 0, 0]


def test_every_layer_recurrent_is_refused():
    with pytest.raises(ValueError, match="at least one attention layer"):
        KVCacheManager(num_blocks=40, block_size=BS, layer_specs=[MAMBA, MAMBA])

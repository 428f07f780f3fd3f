"""``AttentionBackend.kv_cache_block_views``: every backend's cache seen as keys and values, each
[blocks, block_size, heads, head_size], so that connectors move blocks in one layout. For the backends that run here the
view is checked against what the backend's own forward wrote; for IPEX and XLA against their
documented layouts. ``KVCacheAccess`` reads and writes blocks through the views."""
from __future__ import annotations

import pytest
import torch

from halserve.attention_backends.base import AttentionMetadata
from halserve.attention_backends.cpu_native import CpuNativeAttentionBackend
from halserve.attention_backends.ipex import IpexAttentionBackend
from halserve.attention_backends.torch_ref import TorchAttentionBackend
from halserve.attention_backends.xla import XlaAttentionBackend
from halserve.kv_connectors.base import KVCacheAccess
from halserve.platforms import cpu_kernels

BLOCK, HEADS, HEAD_SIZE, NUM_BLOCKS = 4, 2, 8, 6
TABLE = [3, 1, 5]  # the request's blocks


def _prefill(num_tokens: int) -> AttentionMetadata:
    slots = [TABLE[p // BLOCK] * BLOCK + p % BLOCK for p in range(num_tokens)]
    starts = torch.tensor([0, num_tokens], dtype=torch.int32)
    lens = torch.tensor([num_tokens], dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=num_tokens, num_reqs=1, max_query_len=num_tokens, max_seq_len=num_tokens,
        query_start_loc=starts, seq_lens=lens, block_table=torch.tensor([TABLE], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_cpu=starts, seq_lens_cpu=lens)


@pytest.mark.parametrize("backend_cls", [
    TorchAttentionBackend,
    pytest.param(CpuNativeAttentionBackend, marks=pytest.mark.skipif(
        cpu_kernels.toolchain_missing() is not None, reason=f"no C++ toolchain: {cpu_kernels.toolchain_missing()}")),
])
def test_view_holds_what_the_backend_wrote(backend_cls):
    num_tokens = 10
    backend = backend_cls(HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, HEADS)
    cache = torch.zeros(backend_cls.kv_cache_shape(NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE))
    k, v, q = (torch.randn(num_tokens, HEADS, HEAD_SIZE) for _ in range(3))
    backend.forward(q, k, v, cache, backend_cls.build_metadata(_prefill(num_tokens)))
    keys, values = backend_cls.kv_cache_block_views(cache, BLOCK, HEADS, HEAD_SIZE)
    assert keys.shape == values.shape == (NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE)
    for p in range(num_tokens):
        block, offset = TABLE[p // BLOCK], p % BLOCK
        torch.testing.assert_close(keys[block, offset], k[p], rtol=0, atol=0)
        torch.testing.assert_close(values[block, offset], v[p], rtol=0, atol=0)

    # blocks copied out and into another cache of the same backend land where its kernel reads them
    data = KVCacheAccess([(keys, values)]).read([3, 1])
    assert data.shape == (2, 1, 2, BLOCK, HEADS, HEAD_SIZE)
    other = torch.zeros_like(cache)
    KVCacheAccess([backend_cls.kv_cache_block_views(other, BLOCK, HEADS, HEAD_SIZE)]).write([2, 4], data)
    q2 = torch.randn(1, HEADS, HEAD_SIZE)  # a decode at position 10 over blocks 2, 4 (then 5) of the copy
    table, step = [2, 4, 5], _prefill(1)
    step.block_table = torch.tensor([table], dtype=torch.int32)
    step.seq_lens = step.seq_lens_cpu = torch.tensor([num_tokens + 1], dtype=torch.int32)
    step.max_seq_len = num_tokens + 1
    step.slot_mapping = torch.tensor([5 * BLOCK + num_tokens % BLOCK])
    k2, v2 = torch.randn(1, HEADS, HEAD_SIZE), torch.randn(1, HEADS, HEAD_SIZE)
    other[(slice(None), 5)] = cache[(slice(None), 5)]  # (the third block: its first two tokens)
    copied = backend.forward(q2, k2, v2, other, backend_cls.build_metadata(step))
    step.block_table = torch.tensor([TABLE], dtype=torch.int32)
    original = backend.forward(q2, k2, v2, cache, backend_cls.build_metadata(step))
    torch.testing.assert_close(copied, original, rtol=0, atol=0)


def test_ipex_and_xla_views_follow_their_layouts():
    ipex = torch.randn(IpexAttentionBackend.kv_cache_shape(NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE))
    keys, values = IpexAttentionBackend.kv_cache_block_views(ipex, BLOCK, HEADS, HEAD_SIZE)
    assert keys.shape == values.shape == (NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE)
    assert torch.equal(values[4, 3, 1], ipex[1, 4, 1, 3])  # ipex: [2, blocks, heads, block_size, head_size]
    xla = torch.randn(XlaAttentionBackend.kv_cache_shape(NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE))
    keys, values = XlaAttentionBackend.kv_cache_block_views(xla, BLOCK, HEADS, HEAD_SIZE)
    assert keys.shape == values.shape == (NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE)
    assert torch.equal(keys[4, 3, 1], xla[4, 3, 2])  # xla: key of head h at 2h, its value at 2h + 1
    assert torch.equal(values[4, 3, 1], xla[4, 3, 3])
    values[2, 0, 0] = 7.0  # (views: writes reach the backend's tensor)
    assert torch.equal(xla[2, 0, 1], torch.full((HEAD_SIZE,), 7.0))

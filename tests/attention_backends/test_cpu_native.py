"""The CPU platform's native decode backend against the torch reference backend."""
from __future__ import annotations

import pytest
import torch

from halserve.attention_backends.base import AttentionMetadata
from halserve.attention_backends.cpu_native import CpuNativeAttentionBackend
from halserve.attention_backends.torch_ref import TorchAttentionBackend
from halserve.platforms import cpu_kernels

pytestmark = pytest.mark.skipif(
    cpu_kernels.toolchain_missing() is not None, reason=f"no C++ toolchain: {cpu_kernels.toolchain_missing()}"
)


def _step(query_lens, seq_lens, block_size, num_blocks, gen):
    num_reqs = len(query_lens)
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0 is the null block
    block_table = perm[: num_reqs * max_blocks].view(num_reqs, max_blocks).to(torch.int32)
    slots = []
    for r in range(num_reqs):
        for p in range(seq_lens[r] - query_lens[r], seq_lens[r]):
            slots.append(int(block_table[r, p // block_size]) * block_size + p % block_size)
    starts = torch.tensor([0] + list(query_lens)).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=sum(query_lens), num_reqs=num_reqs, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc=starts, seq_lens=lens, block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_cpu=starts, seq_lens_cpu=lens,
    )


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size,window,soft_cap",
    [(4, 4, 64, 16, None, None), (8, 2, 64, 16, None, None), (6, 1, 32, 4, None, None),
     (8, 2, 80, 16, 9, None), (4, 2, 64, 8, None, 30.0), (12, 4, 128, 32, 20, 5.0)],
)
def test_matches_torch_backend(num_heads, num_kv_heads, head_size, block_size, window, soft_cap):
    gen = torch.Generator().manual_seed(num_heads * 31 + head_size)
    # decodes of various lengths mixed with a fresh prefill and a chunked prefill after a prefix
    query_lens = [1, 9, 1, 1, 5, 1]
    seq_lens = [1, 9, 37, 16, 40, 70]
    num_blocks = len(query_lens) * -(-max(seq_lens) // block_size) + 5
    meta_args = _step(query_lens, seq_lens, block_size, num_blocks, gen)
    shape = TorchAttentionBackend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    cache = torch.randn(shape, generator=gen)  # the cached prefix: random history
    t = sum(query_lens)
    q = torch.randn(t, num_heads, head_size, generator=gen)
    k = torch.randn(t, num_kv_heads, head_size, generator=gen)
    v = torch.randn(t, num_kv_heads, head_size, generator=gen)
    kwargs = dict(sliding_window=window, logits_soft_cap=soft_cap)
    ref = TorchAttentionBackend(num_heads, head_size, head_size**-0.5, num_kv_heads, **kwargs)
    nat = CpuNativeAttentionBackend(num_heads, head_size, head_size**-0.5, num_kv_heads, **kwargs)
    assert nat._kernel is not None, cpu_kernels.load_error()
    cache_ref, cache_nat = cache.clone(), cache.clone()
    want = ref.forward(q, k, v, cache_ref, TorchAttentionBackend.build_metadata(meta_args))
    got = nat.forward(q, k, v, cache_nat, CpuNativeAttentionBackend.build_metadata(meta_args))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert torch.equal(cache_ref, cache_nat)


def test_non_float32_falls_back_to_torch_path():
    gen = torch.Generator().manual_seed(0)
    meta_args = _step([1, 1], [5, 17], 16, 8, gen)
    cache = torch.randn(TorchAttentionBackend.kv_cache_shape(8, 16, 2, 64), generator=gen).to(torch.bfloat16)
    q = torch.randn(2, 4, 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(2, 2, 64, generator=gen).to(torch.bfloat16)
    ref = TorchAttentionBackend(4, 64, 0.125, 2).forward(q, k, k, cache.clone(), TorchAttentionBackend.build_metadata(meta_args))
    got = CpuNativeAttentionBackend(4, 64, 0.125, 2).forward(q, k, k, cache.clone(),
                                                            CpuNativeAttentionBackend.build_metadata(meta_args))
    assert torch.equal(got, ref)

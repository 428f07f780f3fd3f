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


def _history_step(history, block_table, block_size):
    """Step 1 of the two-step tests: each request computes its whole history in one
    prefill, on the block tables of step 2."""
    starts = torch.tensor([0] + history).cumsum(0).to(torch.int32)
    lens = torch.tensor(history, dtype=torch.int32)
    slots = [int(block_table[r, p // block_size]) * block_size + p % block_size
             for r, h in enumerate(history) for p in range(h)]
    return AttentionMetadata(
        num_actual_tokens=sum(history), num_reqs=len(history), max_query_len=max(history),
        max_seq_len=max(history), query_start_loc=starts, seq_lens=lens, block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_cpu=starts, seq_lens_cpu=lens,
    )


def _run(backend_cls, steps, num_heads, num_kv_heads, head_size, block_size, num_blocks, kwargs, gen_seed,
         dtype=torch.float32, rounded_to=None, cache_dtype=None):
    """Runs ``steps`` in ``dtype``; ``rounded_to`` rounds the random inputs through that
    dtype first (a float32 reference run on exactly the inputs a bfloat16 run sees);
    ``cache_dtype`` (default ``dtype``) is the cache's."""
    gen = torch.Generator().manual_seed(gen_seed)
    backend = backend_cls(num_heads, head_size, head_size**-0.5, num_kv_heads, **kwargs)
    cache = torch.zeros(backend_cls.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size),
                        dtype=cache_dtype or dtype)
    outs = []
    for meta_args in steps:
        t = meta_args.num_actual_tokens
        qkv = [torch.randn(t, heads, head_size, generator=gen) for heads in (num_heads, num_kv_heads, num_kv_heads)]
        q, k, v = (x.to(rounded_to or dtype).to(dtype) for x in qkv)
        outs.append(backend.forward(q, k, v, cache, backend_cls.build_metadata(meta_args)))
    return outs


def _assert_two_steps_match(history, query_lens, num_heads, num_kv_heads, head_size, block_size, window, soft_cap,
                            *, gen_seed, run_seed, spare_blocks, dtype=torch.float32):
    """Step 1 prefills every request's history; step 2 schedules ``query_lens`` after it.
    Each backend fills its own cache layout; cpu_native must match the torch backend.
    In bfloat16 the reference is the torch backend in float32 on the same (rounded) inputs:
    the kernels compute in float32, so the only difference is the output's bf16 rounding."""
    gen = torch.Generator().manual_seed(gen_seed)
    seq_lens = [h + q for h, q in zip(history, query_lens)]
    num_blocks = len(history) * -(-max(seq_lens) // block_size) + spare_blocks
    step2 = _step(query_lens, seq_lens, block_size, num_blocks, gen)
    step1 = _history_step(history, step2.block_table, block_size)
    kwargs = dict(sliding_window=window, logits_soft_cap=soft_cap)
    args = (num_heads, num_kv_heads, head_size, block_size, num_blocks, kwargs, run_seed)
    want = _run(TorchAttentionBackend, [step1, step2], *args, rounded_to=dtype)
    got = _run(CpuNativeAttentionBackend, [step1, step2], *args, dtype=dtype)
    for w, g in zip(want, got):
        assert g.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
        elif cpu_kernels.load().paged_prefill_supported(num_heads, num_kv_heads, head_size, block_size):
            # All native: float32 inside, one bf16 rounding of the output (2^-8 relative).
            torch.testing.assert_close(g.float(), w, atol=1e-5, rtol=2**-8)
        else:  # prefills through the SDPA fallback, which computes in bf16 itself
            torch.testing.assert_close(g.float(), w, atol=1e-2, rtol=2**-8)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size,window,soft_cap",
    [(4, 4, 64, 16, None, None), (8, 2, 64, 16, None, None), (6, 1, 32, 4, None, None),
     (8, 2, 80, 16, 9, None), (4, 2, 64, 8, None, 30.0), (12, 4, 128, 32, 20, 5.0)],
)
def test_matches_torch_backend(num_heads, num_kv_heads, head_size, block_size, window, soft_cap):
    """Step 1 prefills every request's history; step 2 mixes decodes, a fresh prefill and
    a chunked prefill over the cached prefix. Each backend fills its own cache layout."""
    history = [1, 1, 36, 15, 35, 69]          # cached before step 2
    query_lens = [1, 9, 1, 1, 5, 1]           # step 2
    _assert_two_steps_match(history, query_lens, num_heads, num_kv_heads, head_size, block_size, window, soft_cap,
                            gen_seed=num_heads * 31 + head_size, run_seed=7, spare_blocks=5)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size,window,soft_cap",
    [(12, 4, 64, 16, None, None), (8, 2, 80, 16, 9, None), (6, 1, 32, 4, None, None), (4, 2, 64, 8, None, 30.0),
     (20, 2, 32, 16, None, None), (14, 2, 32, 32, None, 10.0)],
)
def test_bfloat16_matches_float32_reference(num_heads, num_kv_heads, head_size, block_size, window, soft_cap):
    """bf16 q/k/v/cache/output through every path (fast and generic decode, native prefill,
    SDPA fallback for block 8 / group 10): float32 math inside, so within one output rounding."""
    history = [37, 1, 36, 15, 2, 69]
    query_lens = [20, 1, 1, 9, 17, 1]
    _assert_two_steps_match(history, query_lens, num_heads, num_kv_heads, head_size, block_size, window, soft_cap,
                            gen_seed=num_heads * 3 + head_size, run_seed=13, spare_blocks=3, dtype=torch.bfloat16)
    decode_history = [1, 300, 17, 64]
    _assert_two_steps_match(decode_history, [1] * 4, num_heads, num_kv_heads, head_size, block_size, window, soft_cap,
                            gen_seed=num_heads * 5 + block_size, run_seed=17, spare_blocks=2, dtype=torch.bfloat16)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size,window,soft_cap",
    [(9, 3, 64, 16, None, None), (8, 2, 80, 16, 9, None), (6, 1, 32, 4, None, None), (20, 2, 32, 16, None, 10.0)],
)
def test_a_16_bit_cache_under_float32(num_heads, num_kv_heads, head_size, block_size, window, soft_cap, cache_dtype):
    """kv_cache_dtype="bfloat16" / "float16" under a float32 model: float32 q/k/v and output, the cache in the
    16-bit type (written rounded, read widened) through the fast and generic decode, native prefill and the SDPA
    fallback (block 4, group 10). With k/v already exact in that type the rounding is exact, so the result is the
    float32 one: against the torch backend on a float32 cache, and against the torch backend on its own 16-bit
    cache."""
    history = [37, 1, 36, 15, 2, 69]
    query_lens = [20, 1, 1, 9, 17, 1]
    gen = torch.Generator().manual_seed(num_heads * 7 + head_size)
    seq_lens = [h + q for h, q in zip(history, query_lens)]
    num_blocks = len(history) * -(-max(seq_lens) // block_size) + 3
    step2 = _step(query_lens, seq_lens, block_size, num_blocks, gen)
    step1 = _history_step(history, step2.block_table, block_size)
    kwargs = dict(sliding_window=window, logits_soft_cap=soft_cap)
    args = (num_heads, num_kv_heads, head_size, block_size, num_blocks, kwargs, 23)
    setting = str(cache_dtype).removeprefix("torch.")
    want = _run(TorchAttentionBackend, [step1, step2], *args, rounded_to=cache_dtype)
    torch_16 = _run(TorchAttentionBackend, [step1, step2], *args[:5], {**kwargs, "kv_cache_dtype": setting},
                    23, rounded_to=cache_dtype, cache_dtype=cache_dtype)
    got = _run(CpuNativeAttentionBackend, [step1, step2], *args[:5], {**kwargs, "kv_cache_dtype": setting},
               23, rounded_to=cache_dtype, cache_dtype=cache_dtype)
    for w, t, g in zip(want, torch_16, got):
        assert g.dtype == t.dtype == torch.float32
        torch.testing.assert_close(t, w, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_a_16_bit_cache_rounds_what_it_stores(cache_dtype):
    """Float32 keys and values that the 16-bit type cannot hold are stored rounded to nearest even, exactly as
    torch's conversion rounds them (write_kv; float16 past its range: inf, as torch), and decode reads exactly
    those values: the output equals float32 attention over the rounded keys and values."""
    kernel = cpu_kernels.load()
    gen = torch.Generator().manual_seed(5)
    num_heads, num_kv_heads, head_size, block_size, tokens = 4, 2, 64, 16, 40
    k = torch.randn(tokens, num_kv_heads, head_size, generator=gen)
    v = torch.randn(tokens, num_kv_heads, head_size, generator=gen)
    # values at the type's edges: halfway cases, float16's subnormals and its overflow
    v[0, 0, :6] = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 3e-6, -6e-8, 7e4, -1e5])
    q = torch.randn(1, num_heads, head_size, generator=gen)
    shape = CpuNativeAttentionBackend.kv_cache_shape(4, block_size, num_kv_heads, head_size)
    cache, cache32 = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape)
    slots = torch.arange(block_size, block_size + tokens)  # blocks 1-3
    kernel.write_kv(cache, k, v, slots, block_size)
    kernel.write_kv(cache32, k.to(cache_dtype).float(), v.to(cache_dtype).float(), slots, block_size)
    assert torch.equal(cache.float(), cache32)  # rounded as torch rounds
    table, lens = torch.tensor([[1, 2, 3]], dtype=torch.int32), torch.tensor([tokens], dtype=torch.int32)
    v[0, 0, 4:6] = 0  # (decode over finite values)
    kernel.write_kv(cache, k, v, slots, block_size)
    kernel.write_kv(cache32, k.to(cache_dtype).float(), v.to(cache_dtype).float(), slots, block_size)
    got = kernel.paged_decode(q, cache, table, lens, block_size, head_size**-0.5, 0, 0.0)
    want = kernel.paged_decode(q, cache32, table, lens, block_size, head_size**-0.5, 0, 0.0)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="float16 under float32"):
        kernel.paged_decode(q.bfloat16(), cache32, table, lens, block_size, head_size**-0.5, 0, 0.0)


def test_declines_what_it_does_not_run():
    assert CpuNativeAttentionBackend.supports(dtype="float16", head_size=64, block_size=16)
    assert CpuNativeAttentionBackend.supports(dtype="bfloat16", head_size=64, block_size=16) is None
    assert CpuNativeAttentionBackend.supports(dtype="float32", head_size=64, block_size=16, kv_cache_dtype="fp8")
    assert CpuNativeAttentionBackend.supports(dtype="float32", head_size=64, block_size=16) is None
    for cache in ("float32", "bfloat16", "float16"):  # a 16-bit (or float32) cache under a float32 model
        assert CpuNativeAttentionBackend.supports(dtype="float32", head_size=64, block_size=16,
                                                  kv_cache_dtype=cache) is None
    # under a bfloat16 model only its own dtype: the kernels take the cache in q's dtype or 16-bit under float32
    assert CpuNativeAttentionBackend.supports(dtype="bfloat16", head_size=64, block_size=16,
                                              kv_cache_dtype="bfloat16") is None
    for cache in ("float32", "float16"):
        assert "under a bfloat16 model" in CpuNativeAttentionBackend.supports(
            dtype="bfloat16", head_size=64, block_size=16, kv_cache_dtype=cache)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size,window,soft_cap",
    [(12, 4, 64, 16, None, None), (16, 2, 128, 64, None, None), (8, 8, 96, 32, 40, None),
     (6, 3, 64, 16, None, 20.0), (20, 2, 32, 16, None, None), (4, 1, 48, 8, None, None)],
)
def test_decode_only_step_matches_torch_backend(num_heads, num_kv_heads, head_size, block_size, window, soft_cap):
    """A step of decodes only, in batch order (the fast path that returns the kernel's
    output directly), over long and short contexts: vectorised softmax (group sizes 1..8,
    blocks of 16/32/64) and the generic kernel (group 10, block 8, head size 48)."""
    history = [1, 300, 17, 64, 129, 2, 16, 95]
    _assert_two_steps_match(history, [1] * len(history), num_heads, num_kv_heads, head_size, block_size, window, soft_cap,
                            gen_seed=num_heads * 7 + block_size, run_seed=11, spare_blocks=3)


def test_write_kv_places_keys_transposed_and_rejects_bad_slots():
    kernel = cpu_kernels.load()
    num_blocks, heads, block_size, head_size = 4, 2, 8, 16
    cache = torch.zeros(CpuNativeAttentionBackend.kv_cache_shape(num_blocks, block_size, heads, head_size))
    k = torch.randn(3, heads, head_size)
    v = torch.randn(3, heads, head_size)
    slots = torch.tensor([9, 31, -1])  # block 1 offset 1, block 3 offset 7, padding
    kernel.write_kv(cache, k, v, slots, block_size)
    keys = cache[0].view(num_blocks, heads, head_size, block_size)
    values = cache[1].view(num_blocks, heads, block_size, head_size)
    torch.testing.assert_close(keys[1, :, :, 1], k[0], rtol=0, atol=0)
    torch.testing.assert_close(values[3, :, 7, :], v[1], rtol=0, atol=0)
    assert int((cache != 0).sum()) == 2 * 2 * heads * head_size  # the padding token wrote nothing
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel.write_kv(cache, k[:1], v[:1], torch.tensor([num_blocks * block_size]), block_size)


def test_exp_underflow_gives_negligible_weight():
    """One key scores 100 below the rest: its weight underflows (the vectorised exp's
    2^n exponent trick must give ~0 there, not a wrapped-around huge number)."""
    kernel = cpu_kernels.load()
    block_size, head_size = 16, 16
    cache = torch.zeros(CpuNativeAttentionBackend.kv_cache_shape(3, block_size, 1, head_size))
    k = torch.zeros(20, 1, head_size)
    k[0, 0, 0] = 100.0  # token 0 scores 100 * q[0]; the rest score 0
    v = torch.arange(20, dtype=torch.float32).view(20, 1, 1).expand(20, 1, head_size).contiguous()
    slots = torch.tensor([1 * block_size + t for t in range(16)] + [2 * block_size + t for t in range(4)])
    kernel.write_kv(cache, k, v, slots, block_size)
    q = torch.zeros(1, 1, head_size)
    q[0, 0, 0] = -1.0  # token 0 scores -100: weight e^-100 -> 0 in float32
    out = kernel.paged_decode(q, cache, torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32),
                              block_size, 1.0, 0, 0.0)
    assert torch.allclose(out, torch.full_like(out, sum(range(1, 20)) / 19), atol=1e-5)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size,window,soft_cap",
    [(3, 3, 64, 16, None, None), (4, 2, 64, 16, None, None), (12, 4, 64, 16, 24, None), (10, 2, 128, 64, None, None),
     (14, 2, 32, 32, None, 10.0), (16, 2, 64, 16, 7, None)],
)
def test_long_prefills_and_chunks_match_torch_backend(num_heads, num_kv_heads, head_size, block_size, window, soft_cap):
    """The native prefill kernel (all spans in one call, tiles of 3-16 query positions):
    fresh prompts of many lengths, then chunks after cached context next to decodes."""
    history = [37, 100, 5, 16, 2, 61]
    query_lens = [20, 33, 2, 1, 17, 1]
    _assert_two_steps_match(history, query_lens, num_heads, num_kv_heads, head_size, block_size, window, soft_cap,
                            gen_seed=num_heads + head_size + block_size, run_seed=5, spare_blocks=2)


def test_prefill_kernel_rejects_bad_spans():
    kernel = cpu_kernels.load()
    cache = torch.zeros(CpuNativeAttentionBackend.kv_cache_shape(4, 16, 2, 64))
    q = torch.randn(8, 4, 64)
    table = torch.tensor([[1, 2]], dtype=torch.int32)
    args = (16, 0.125, 0, 0.0)
    one = lambda x: torch.tensor([x])  # noqa: E731
    with pytest.raises(RuntimeError, match="outside the batch"):
        kernel.paged_prefill(torch.empty_like(q), q, cache, table, one(4), one(5), one(9), one(0), *args)
    with pytest.raises(RuntimeError, match="seq_len out of range"):
        kernel.paged_prefill(torch.empty_like(q), q, cache, table, one(0), one(8), one(33), one(0), *args)
    with pytest.raises(RuntimeError, match="row out of range"):
        kernel.paged_prefill(torch.empty_like(q), q, cache, table, one(0), one(8), one(8), one(1), *args)
    assert not kernel.paged_prefill_supported(4, 2, 64, 8)  # block size 8: the SDPA path
    assert not kernel.paged_prefill_supported(20, 2, 64, 16)  # group of 10


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("num_heads,num_kv_heads,rotary_dim", [(9, 3, 64), (4, 4, 32)])
def test_rotary_write_decode_is_the_three_kernels_in_one_call(num_heads, num_kv_heads, rotary_dim, is_neox):
    """The flat forward's fused decode call (models/llama_flat.py): rotary, write_kv and paged_decode from the
    qkv rows give the same output and the same cache, bit for bit, as the three kernels called in turn."""
    kernel, gen = cpu_kernels.load(), torch.Generator().manual_seed(7)
    head, block_size, num_blocks = 64, 16, 24
    seq_lens = [1, 17, 40]
    meta = _step([1] * len(seq_lens), seq_lens, block_size, num_blocks, gen)
    positions = torch.tensor([s - 1 for s in seq_lens])
    cos_sin = torch.randn(64, rotary_dim, generator=gen)
    qkv = torch.randn(len(seq_lens), (num_heads + 2 * num_kv_heads) * head, generator=gen)
    cache = torch.randn(2, num_blocks, num_kv_heads, block_size * head, generator=gen)
    want_cache, got_cache = cache.clone(), cache.clone()
    q_size, kv_size = num_heads * head, num_kv_heads * head
    q, k = kernel.rotary(positions, qkv[:, :q_size], qkv[:, q_size:q_size + kv_size], cos_sin, head, is_neox)
    v = qkv[:, q_size + kv_size:].contiguous()
    kernel.write_kv(want_cache, k.view(-1, num_kv_heads, head), v.view(-1, num_kv_heads, head), meta.slot_mapping,
                    block_size)
    want = kernel.paged_decode(q.view(-1, num_heads, head), want_cache, meta.block_table, meta.seq_lens, block_size,
                               0.125, 0, 0.0)
    got = kernel.rotary_write_decode(qkv, positions, cos_sin, num_heads, num_kv_heads, head, is_neox, got_cache,
                                     meta.slot_mapping, meta.block_table, meta.seq_lens, block_size, 0.125, 0, 0.0)
    assert got.shape == (len(seq_lens), q_size)
    assert torch.equal(got, want.view(len(seq_lens), q_size))
    assert torch.equal(got_cache, want_cache)
    assert not torch.equal(got_cache, cache)  # (it wrote)
    with pytest.raises(RuntimeError, match="qkv must be"):
        kernel.rotary_write_decode(qkv[:, 1:], positions, cos_sin, num_heads, num_kv_heads, head, is_neox, got_cache,
                                   meta.slot_mapping, meta.block_table, meta.seq_lens, block_size, 0.125, 0, 0.0)

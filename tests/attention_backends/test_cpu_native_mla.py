"""The cpu_native backend's MLA decode (platforms/cpu_kernels/mla_decode.cpp, the ``mla`` library): the
kernel against softmax attention over the latent rows in float64, and ``forward_mla`` against the torch
reference backend's, for float32, bfloat16 and fp8 latent pages, several block sizes, ragged lengths and
every head count from 1 to 16 (and 20: two head groups). The same tests also run against an AVX2-only
build of the kernels (the last test)."""
from __future__ import annotations

import math
import os
import platform
import subprocess
import sys

import pytest
import torch

from halserve.attention_backends.base import AttentionMetadata
from halserve.attention_backends.cpu_native import CpuNativeAttentionBackend
from halserve.attention_backends.torch_ref import TorchAttentionBackend
from halserve.platforms import cpu_kernels
from halserve.platforms.cpu_kernels.panel import cpu_flags

pytestmark = pytest.mark.skipif(
    cpu_kernels.toolchain_missing() is not None, reason=f"no C++ toolchain: {cpu_kernels.toolchain_missing()}"
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.fixture(scope="module")
def mla_decode():
    if cpu_kernels.load_library("mla") is None:
        pytest.fail(f"the mla kernel library did not build: {cpu_kernels.load_error('mla')}")
    return torch.ops.halserve_cpu_mla.mla_decode


def _paged(lens: list[int], block_size: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Block tables [N, max_blocks + 1] int32 over shuffled blocks (block 0 unused), and the number of blocks."""
    per_req = [-(-n // block_size) for n in lens]
    num_blocks = 1 + sum(per_req) + 2
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(lens), max(per_req) + 1, dtype=torch.int32)  # (+1: a row wider than any context)
    for n, count in enumerate(per_req):
        table[n, :count] = torch.tensor([order.pop() for _ in range(count)], dtype=torch.int32)
    return table, num_blocks


def _reference(q, cache, block_table, seq_lens, rank, scale, k_scale):
    """softmax(scale * q . rows) @ rows[:, :rank] per request in float64, rows read back as the cache holds them."""
    block_size, out = cache.shape[1], []
    for n, length in enumerate(seq_lens.tolist()):
        rows = torch.stack([cache[int(block_table[n, t // block_size]), t % block_size] for t in range(length)])
        rows = rows.double() * (k_scale if cache.dtype.itemsize == 1 else 1.0)  # [L, E]
        probs = (q[n].double() @ rows.T * scale).softmax(-1)  # [H, L]
        out.append(probs @ rows[:, :rank])
    return torch.stack(out).float()  # [N, H, rank]


@pytest.mark.parametrize("cache_dtype", list(CACHE_DTYPES))
def test_kernel_matches_softmax_over_the_latent_rows(mla_decode, cache_dtype):
    """Head counts 1..16 and 20 over block sizes 1, 3, 4 and 16, ragged lengths (a one-position context,
    lengths off the block and tile edges), rank and rope widths that are and are not multiples of 16, and
    one long context that the kernel splits over the threads."""
    gen = torch.Generator().manual_seed(0)
    cases = [(heads, block_size, rank, rope, lens)
             for heads, block_size, (rank, rope), lens in zip(
                 list(range(1, 17)) + [20],
                 [1, 3, 4, 16] * 5,
                 [(32, 8), (16, 0), (48, 16), (40, 6), (512, 64)] * 4,
                 [[9, 1, 13], [17], [2, 31, 8, 5], [1], [64, 3]] * 4)]
    cases.append((16, 16, 128, 32, [1000]))  # one request, 1000 positions: split into several tasks
    scale, k_scale = 0.125, 0.7
    for heads, block_size, rank, rope, lens in cases:
        table, num_blocks = _paged(lens, block_size, gen)
        cache = torch.randn(num_blocks, block_size, rank + rope, generator=gen).to(CACHE_DTYPES[cache_dtype])
        q = torch.randn(len(lens), heads, rank + rope, generator=gen)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        got = mla_decode(q, cache, table, seq_lens, rank, scale, k_scale)
        want = _reference(q, cache, table, seq_lens, rank, scale, k_scale)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5,
                                   msg=lambda m: f"heads {heads}, block {block_size}, {rank}+{rope}, lens {lens}: {m}")


def test_kernel_refuses_bad_inputs(mla_decode):
    cache = torch.zeros(4, 2, 24)
    table = torch.tensor([[1, 7]], dtype=torch.int32)
    q = torch.zeros(1, 2, 24)
    with pytest.raises(RuntimeError, match="block id 7 of request 0 is outside the cache"):
        mla_decode(q, cache, table, torch.tensor([3], dtype=torch.int32), 16, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="seq_len 5 of request 0 is out of range"):
        mla_decode(q, cache, table, torch.tensor([5], dtype=torch.int32), 16, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="float32, bfloat16, float16, float8_e4m3fn or float8_e5m2"):
        mla_decode(q, cache.double(), table, torch.tensor([2], dtype=torch.int32), 16, 1.0, 1.0)


def _metadata(query_lens: list[int], seq_lens: list[int], table: torch.Tensor, block_size: int):
    slots, starts = [], [0]
    for r, (q, s) in enumerate(zip(query_lens, seq_lens)):
        slots += [int(table[r, p // block_size]) * block_size + p % block_size for p in range(s - q, s)]
        starts.append(starts[-1] + q)
    qsl, sl = torch.tensor(starts, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
    common = AttentionMetadata(
        num_actual_tokens=starts[-1], num_reqs=len(query_lens), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc=qsl, seq_lens=sl, block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_cpu=qsl, seq_lens_cpu=sl)
    return TorchAttentionBackend.build_metadata(common)


@pytest.mark.parametrize("dtype,kv_cache_dtype", [("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8"),
                                                  ("bfloat16", "fp8_e5m2")])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_forward_mla_matches_the_torch_backend(dtype, kv_cache_dtype, block_size):
    """Three steps on one cache per backend: every request's history as prefills; a step with a chunk after
    cached context between two decodes (not the batch's first tokens) and a padded token; then decodes only."""
    gen = torch.Generator().manual_seed(block_size)
    heads, rank, rope, nope, v_dim = 5, 64, 16, 32, 32
    scale, k_scale = (nope + rope) ** -0.5, 0.5 if kv_cache_dtype != "auto" else 1.0
    torch_dtype = getattr(torch, dtype)
    w_uk = (torch.randn(heads, nope, rank, generator=gen) / math.sqrt(rank)).to(torch_dtype)
    w_uv = (torch.randn(heads, v_dim, rank, generator=gen) / math.sqrt(rank)).to(torch_dtype)
    history, chunk = [7, 40, 19], [1, 6, 1]  # request 1 prefills a 6-token chunk; 0 and 2 decode
    lens = [h + c + 1 for h, c in zip(history, chunk)]
    table, num_blocks = _paged(lens, block_size, gen)
    steps = [(history, history), (chunk, [h + c for h, c in zip(history, chunk)]), ([1, 1, 1], lens)]
    backends = [cls(heads, nope + rope, scale, 1, kv_cache_dtype=kv_cache_dtype)
                for cls in (TorchAttentionBackend, CpuNativeAttentionBackend)]
    cache_dtype = CACHE_DTYPES[kv_cache_dtype if kv_cache_dtype != "auto" else dtype]
    caches = [torch.zeros(num_blocks, block_size, rank + rope, dtype=cache_dtype) for _ in backends]
    for i, (query_lens, seq_lens) in enumerate(steps):
        meta_args = _metadata(query_lens, seq_lens, table, block_size)
        t = meta_args.num_actual_tokens + (i == 1)  # step 1: one padded token past the real ones
        inputs = [torch.randn(t, heads, nope, generator=gen), torch.randn(t, heads, rope, generator=gen),
                  torch.randn(t, rank, generator=gen), torch.randn(t, rope, generator=gen)]
        inputs = [x.to(torch_dtype) for x in inputs]
        want, got = (b.forward_mla(*inputs, cache, _metadata(query_lens, seq_lens, table, block_size), w_uk, w_uv,
                                   k_scale) for b, cache in zip(backends, caches))
        assert got.shape == want.shape == (t, heads, v_dim) and got.dtype == torch_dtype
        # both hold the same pages; float32 computes alike, bf16 differs by the reference's bf16 scores
        torch.testing.assert_close(caches[1], caches[0], atol=0, rtol=0)
        tol = 1e-5 if dtype == "float32" else 3e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"step {i}: {m}")
        if i == 1:
            assert not got[-1].any()  # the padded token


def test_forward_mla_matches_the_torch_backend_for_every_head_count():
    """Heads 1..16 (float32), each over another block size and ragged contexts: a prefill step writes the
    history through each backend, then a decode step of every request reads it back."""
    gen = torch.Generator().manual_seed(7)
    rank, rope, nope, v_dim = 32, 8, 16, 16
    for heads in range(1, 17):
        block_size = [1, 3, 4, 16][heads % 4]
        history = [1 + (5 * heads + 7 * i) % 29 for i in range(3)]
        lens = [h + 1 for h in history]
        table, num_blocks = _paged(lens, block_size, gen)
        w_uk = torch.randn(heads, nope, rank, generator=gen) / math.sqrt(rank)
        w_uv = torch.randn(heads, v_dim, rank, generator=gen) / math.sqrt(rank)
        backends = [cls(heads, nope + rope, (nope + rope) ** -0.5, 1)
                    for cls in (TorchAttentionBackend, CpuNativeAttentionBackend)]
        caches = [torch.zeros(num_blocks, block_size, rank + rope) for _ in backends]
        for query_lens, seq_lens in ((history, history), ([1, 1, 1], lens)):
            t = sum(query_lens)
            inputs = [torch.randn(t, heads, nope, generator=gen), torch.randn(t, heads, rope, generator=gen),
                      torch.randn(t, rank, generator=gen), torch.randn(t, rope, generator=gen)]
            want, got = (b.forward_mla(*inputs, cache, _metadata(query_lens, seq_lens, table, block_size), w_uk, w_uv)
                         for b, cache in zip(backends, caches))
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"heads {heads}, block {block_size}, lens {seq_lens}: {m}")


def test_the_conformance_kit_passes_the_mla_kind_cpu_native_claims():
    """What a vendor's backend goes through (halserve.plugins.testing): forward_mla against the torch
    reference's over prefill, decode, prefix-hit and mixed steps; fp8 pages declined (not declared)."""
    from halserve.plugins.testing.results import ConformanceReport
    from halserve.plugins.testing.spec_kind_checks import check_claimed_kinds
    from halserve.plugins.testing.target import Target

    assert "mla" in CpuNativeAttentionBackend.kv_cache_spec_kinds()
    report = ConformanceReport("cpu", "cpu", False)
    check_claimed_kinds(report, "cpu_native", CpuNativeAttentionBackend, Target("cpu", "cpu", False, "cpu"), quick=True)
    rows = {r.case: (r.status, r.detail) for r in report.results}
    passed = {case.split()[1] for case, (status, _) in rows.items() if status == "passed"}
    assert passed >= {"prefill_only", "decode_only", "prefix_hit_chunked", "mixed"}, rows
    assert all(status == "passed" or (status == "declined" and "kv=fp8" in case)
               for case, (status, _) in rows.items()), rows


def _has_avx2() -> bool:
    return "avx2" in cpu_flags()


@pytest.mark.extended  # (an AVX2-only build: CI's extended step, as tests/platforms/test_cpu_avx2_build.py)
@pytest.mark.slow  # builds the mla (and core) libraries for AVX2 once per machine (~1-2 min), then ~20 s
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not _has_avx2(),
                    reason="the AVX2 build needs an x86-64 CPU with AVX2")
def test_the_avx2_build_matches_too():
    """This file's tests against kernels built with HALSERVE_CPU_MARCH=x86-64-v3 (a v16 is two ymm
    registers there, and the kernel takes 4 rows per tile instead of 8), in a child process."""
    from halserve.platforms.cpu_kernels.build import MARCH_ENV

    env = dict(os.environ, **{MARCH_ENV: "x86-64-v3"})
    probe = "import torch; from halserve.platforms import cpu_kernels; cpu_kernels.load_library('mla'); " \
            "print(torch.ops.halserve_cpu_mla.mla_decode_avx512())"
    built = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)
    assert built.stdout.strip().splitlines()[-1:] == ["False"], built.stdout + built.stderr  # (the AVX2 build)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not avx2",
                           os.path.relpath(__file__, ROOT)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=800)
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
    assert proc.returncode == 0, f"the AVX2 build's MLA tests failed:\n{tail}"
    assert " passed" in tail and " failed" not in tail, tail

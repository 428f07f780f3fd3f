"""The CPU platform's shared-memory tensor-parallel collectives (``cpu_kernels/shm_comm``), in real
rank processes against gloo's: sums and gathers of every supported dtype, tensors split into
several chunks (a small slot size), non-contiguous inputs, bit-identical results on every rank,
nothing left under /dev/shm, and the fallbacks to gloo."""
from __future__ import annotations

import glob
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from halserve.platforms import cpu_kernels

pytestmark = pytest.mark.skipif(
    cpu_kernels.toolchain_missing() is not None, reason=f"no C++ toolchain: {cpu_kernels.toolchain_missing()}"
)
pytestmark = [pytestmark, pytest.mark.slow]  # one process per rank, ~50 s (inner loop: -m 'not slow')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, out_dir: str, slot_bytes: int) -> None:
    import torch.distributed as dist

    from halserve.platforms.cpu_kernels.shm_comm import ShmCommunicator

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    comm = ShmCommunicator(cpu_kernels.load(), None, rank, world, slot_bytes=slot_bytes)
    results = {}
    gen = torch.Generator().manual_seed(100 + rank)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for shape in ((1,), (3, 5), (37, 64), (513, 33)):  # (the last ones need several chunks)
            x = torch.randn(shape, generator=gen).to(dtype)
            want = x.float().clone()
            dist.all_reduce(want)
            got = comm.all_reduce(x.clone())
            results[("sum", str(dtype), shape)] = (got, want.to(dtype))
        x = torch.randn(9, 70, generator=gen).to(dtype)
        for dim in (0, -1):
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x)
            results[("gather", str(dtype), dim)] = (comm.all_gather(x, dim), torch.cat(parts, dim))
    strided = torch.randn(16, 12, generator=gen)[:, ::3]  # not contiguous: summed in place all the same
    want = strided.clone()
    dist.all_reduce(want)
    got = comm.all_reduce(strided)
    results[("strided",)] = (got if got is strided else None, want)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_sums_and_gathers_match_gloo_on_every_rank(tmp_path, world):
    before = set(glob.glob("/dev/shm/halserve-tp-*"))
    mp.spawn(_rank_main, args=(world, _free_port(), str(tmp_path), 1024), nprocs=world)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for key, (got, want) in ranks[0].items():
        assert got is not None, key
        low_precision = got.dtype in (torch.bfloat16, torch.float16)
        tol = dict(rtol=1e-2, atol=1e-2) if low_precision else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, want, **tol, msg=str(key))
        for other in ranks[1:]:  # every rank has the very same bits (their samplers must agree)
            assert torch.equal(other[key][0], got), key
    assert set(glob.glob("/dev/shm/halserve-tp-*")) == before, "the shared file must be unlinked"


def _fallback_main(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from halserve.platforms.cpu import CpuPlatform

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    comm = CpuPlatform().make_tp_communicator(None, rank, 2)
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(type(comm).__name__)
    dist.destroy_process_group()


@pytest.mark.parametrize("env, expected", [("1", "ShmCommunicator"), ("0", "NoneType")])
def test_the_cpu_platform_uses_it_unless_disabled(tmp_path, monkeypatch, env, expected):
    monkeypatch.setenv("HALSERVE_CPU_SHM_COMM", env)
    mp.spawn(_fallback_main, args=(_free_port(), str(tmp_path)), nprocs=2)
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == [expected, expected]

"""Tensor-parallel collectives between CPU ranks on this machine: gloo against the CPU
platform's shared-memory all-reduce/all-gather (``platforms/cpu_kernels/shm_comm``).

    python benchmarks/tp_collectives.py [--world 2] [--iters 200]

Each rank runs one thread (as the mp executor gives each of two ranks on two cores). Prints the
mean time per call, as seen by rank 0, for W1's shapes: a decode step's layer output [64, 768],
a prefill step's [2048, 768], and the LM head's logits shard [64, 4096] (all-gather).
"""
from __future__ import annotations

import argparse
import socket
import time

import torch
import torch.multiprocessing as mp

SHAPES = [(64, 768), (2048, 768)]
GATHER_SHAPE = (64, 4096)


def _time(fn, iters: int) -> float:
    for _ in range(max(3, iters // 10)):
        fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def _rank_main(rank: int, world: int, port: int, iters: int) -> None:
    import torch.distributed as dist

    from halserve.platforms import cpu_kernels
    from halserve.platforms.cpu_kernels.shm_comm import ShmCommunicator

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    comm = ShmCommunicator(cpu_kernels.load(), None, rank, world)
    rows = []
    for shape in SHAPES:
        x = torch.randn(shape)
        n = iters if shape[0] <= 64 else max(10, iters // 10)
        rows.append((f"all_reduce {list(shape)}", _time(lambda: dist.all_reduce(x), n),
                     _time(lambda: comm.all_reduce(x), n)))
    x = torch.randn(GATHER_SHAPE)
    parts = [torch.empty_like(x) for _ in range(world)]
    rows.append((f"all_gather {list(GATHER_SHAPE)}", _time(lambda: dist.all_gather(parts, x), iters),
                 _time(lambda: comm.all_gather(x), iters)))
    if rank == 0:
        print(f"{world} ranks, 1 thread each; mean per call")
        print(f"{'collective':<28}{'gloo':>12}{'shared memory':>16}{'speed-up':>10}")
        for name, gloo, shm in rows:
            print(f"{name:<28}{gloo * 1e6:>10.0f}us{shm * 1e6:>14.0f}us{gloo / shm:>9.1f}x")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(args.world, port, args.iters), nprocs=args.world)


if __name__ == "__main__":
    main()

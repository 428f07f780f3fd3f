"""Tensor-parallel all-reduce and all-gather between CPU ranks of one machine through shared
memory (``shm_comm.cpp``), instead of gloo's TCP loopback.

Measured on the 2-core CI machine, two ranks of one thread each: gloo takes ~1.7 ms to sum a
[64, 768] float32 tensor (a decode step's layer output) and ~5 ms for [2048, 768] (a prefill
step's); a decoder layer needs two of them, so on W1 (12 layers) gloo cost about as much as the
model's arithmetic. See BENCHMARKS.md for the end-to-end figures.

The ranks of a tensor-parallel group agree on a file under /dev/shm (rank 0 creates it and
broadcasts its name over the group), map it (``torch.from_file(shared=True)``), and rank 0
unlinks it once all have: the mapping outlives the name, and nothing is left behind.
"""
from __future__ import annotations

import logging
import os
import socket
import uuid
from typing import Any

import torch

logger = logging.getLogger(__name__)

SLOT_BYTES = 4 << 20  # per rank and slot set: larger tensors go through in chunks
FLAG_BYTES = 64  # (shm_comm.cpp's kFlagBytes)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DISABLE_ENV = "HALSERVE_CPU_SHM_COMM"
"""``0`` keeps the CPU platform's tensor-parallel collectives on torch.distributed (gloo)."""


class ShmCommunicator:
    """One tensor-parallel group's shared buffer. Every rank must call ``all_reduce`` and
    ``all_gather`` in the same order with same-sized tensors, as for any collective."""

    def __init__(self, module: Any, group: Any, rank: int, world_size: int, slot_bytes: int = SLOT_BYTES) -> None:
        import torch.distributed as dist

        self.module, self.rank, self.world_size, self.slot_bytes = module, rank, world_size, slot_bytes
        size = world_size * FLAG_BYTES + 2 * world_size * slot_bytes
        src = 0 if group is None else dist.get_global_rank(group, 0)
        path = [f"/dev/shm/halserve-tp-{uuid.uuid4().hex}" if rank == 0 else None]
        if rank == 0:
            with open(path[0], "wb") as f:
                f.truncate(size)  # (zero-filled: every flag starts at 0)
        dist.broadcast_object_list(path, src=src, group=group)
        try:
            self.buffer = torch.from_file(path[0], shared=True, size=size, dtype=torch.uint8)
        finally:
            dist.barrier(group=group)
            if rank == 0:
                os.unlink(path[0])
        self.seq = 1  # the next chunk's number (shm_comm.cpp)

    def supports(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in DTYPES

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (made contiguous first if it is not)."""
        target = x if x.is_contiguous() else x.contiguous()
        self.seq = self.module.shm_all_reduce(self.buffer, target, self.rank, self.world_size, self.slot_bytes,
                                              self.seq)
        if target is not x:
            x.copy_(target)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order."""
        x = x.contiguous()
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype)
        self.seq = self.module.shm_all_gather(self.buffer, x, out, self.rank, self.world_size, self.slot_bytes,
                                              self.seq)
        return torch.cat(out.unbind(0), dim=dim)


def make_shm_communicator(group: Any, rank: int, world_size: int) -> ShmCommunicator | None:
    """A ShmCommunicator for the group when its ranks share this machine and the native kernels
    build; None (torch.distributed then) otherwise, with the reason logged."""
    import torch.distributed as dist

    from halserve.platforms import cpu_kernels

    hosts: list[Any] = [None] * world_size
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    # (every rank decides alike: the same inputs on every rank, or a rank that fails says so to all)
    module = cpu_kernels.load()
    usable = [None] * world_size
    dist.all_gather_object(usable, module is not None and os.environ.get(DISABLE_ENV, "1") != "0", group=group)
    if len(set(hosts)) > 1:
        logger.info("tensor-parallel collectives over torch.distributed: the ranks run on %s", sorted(set(hosts)))
        return None
    if not all(usable):
        logger.info("tensor-parallel collectives over torch.distributed: %s",
                    f"{DISABLE_ENV}=0" if module is not None else cpu_kernels.load_error())
        return None
    return ShmCommunicator(module, group, rank, world_size)

"""The device communicator: every collective and point-to-point op halserve runs between ranks.

A platform returns one from ``Platform.make_device_communicator(group, rank, size)`` (plugin API 2)
for each tensor-parallel group, and for the whole world when there are pipeline stages (their
``send``/``recv``). This base class is the default: each op is the torch.distributed call on the
platform's ``dist_backend`` (gloo on the CPU, nccl on CUDA, ...). A vendor subclasses it and
overrides the ops its collective library does faster, calling ``super()`` for the tensors it does
not handle; the conformance kit's ``communicator`` check compares every op with gloo's result on
two processes.

Ranks (``src``, ``dst``) are ranks *within this communicator's group*, 0..size-1; the base class
maps them to global ranks for torch.distributed. Every rank of the group must call a collective in
the same order with tensors of the same shape and dtype, as for any collective.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

OPS = ("all_reduce", "all_gather", "all_to_all", "broadcast", "send", "recv")
"""What a communicator does (the kit checks each)."""


class DeviceCommunicator:
    """One group of ranks' ops, over torch.distributed. Subclasses override any op."""

    def __init__(self, group: Any, rank: int, size: int) -> None:
        """``group``: the torch.distributed ProcessGroup (None: the default, whole-world group);
        ``rank``: this process's rank in it; ``size``: its number of ranks. Called once per group,
        by every rank of it, after torch.distributed is initialised."""
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"DeviceCommunicator(rank={rank}, size={size}): need 0 <= rank < size")
        self.group, self.rank, self.size = group, rank, size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"

    def global_rank(self, rank: int) -> int:
        """The torch.distributed (global) rank of ``rank`` of this group."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not in this communicator's group of {self.size} ranks (0..{self.size - 1})")
        if self.group is None:
            return rank
        return int(torch.distributed.get_global_rank(self.group, rank))

    # -- collectives ---------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks; returns the sum (``x`` itself, summed in place, by default)."""
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order (a new tensor)."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """Expert-parallel exchange: ``x`` is ``size`` equal chunks along dim 0, chunk ``i`` for rank
        ``i``; returns the chunks this rank received, in sender order, concatenated along dim 0::

            rank 0: [a0 a1]          rank 0 gets [a0 b0]
            rank 1: [b0 b1]   --->   rank 1 gets [a1 b1]
        """
        if x.shape[0] % self.size:
            raise ValueError(f"all_to_all: dim 0 of x {tuple(x.shape)} is not divisible by the {self.size} ranks")
        out = torch.empty_like(x)
        torch.distributed.all_to_all_single(out, x.contiguous(), group=self.group)
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` on every rank (in place on the others); returns ``x``."""
        torch.distributed.broadcast(x, src=self.global_rank(src), group=self.group)
        return x

    # -- point to point -------------------------------------------------------------
    def send(self, x: torch.Tensor, dst: int) -> None:
        """Send ``x`` to rank ``dst``, which calls ``recv`` with a tensor of the same shape and dtype."""
        torch.distributed.send(x.contiguous(), dst=self.global_rank(dst), group=self.group)

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Receive rank ``src``'s ``send`` into ``x`` (allocated by the caller); returns ``x``."""
        torch.distributed.recv(x, src=self.global_rank(src), group=self.group)
        return x


def _arg_names(fn: Any) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()]


def check_communicator(comm: Any, platform: str) -> DeviceCommunicator:
    """``comm`` (what ``Platform.make_device_communicator`` returned) if it keeps the contract, else
    a TypeError naming the platform, the class, the op and the mismatch: an instance of a
    ``DeviceCommunicator`` subclass whose overridden ops take the base class's arguments (halserve
    calls them by these names). Called by the worker before it uses one, and by the kit."""
    if not isinstance(comm, DeviceCommunicator):
        raise TypeError(
            f"platform {platform!r}: make_device_communicator returned {comm!r}; return an instance of a "
            "subclass of halserve.distributed.communicator.DeviceCommunicator (its default is the base class)"
        )
    cls = type(comm)
    for op in (*OPS, "__init__"):
        mine, base = getattr(cls, op), getattr(DeviceCommunicator, op)
        if mine is not base and _arg_names(mine) != _arg_names(base):
            raise TypeError(
                f"platform {platform!r}: communicator {cls.__name__}.{op}({', '.join(_arg_names(mine))}) does not "
                f"match DeviceCommunicator.{op}({', '.join(_arg_names(base))}); keep the base class's arguments "
                "(halserve calls them by these names)"
            )
    return comm


__all__ = ["OPS", "DeviceCommunicator", "check_communicator"]

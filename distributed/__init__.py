"""Tensor- and pipeline-parallel state of this process and the collectives layers use.

One rank (the default) needs no setup: every collective is a no-op. A multi-rank
executor's workers call ``init_distributed(backend, init_method, rank, world_size,
tensor_parallel_size)`` (the platform's ``dist_backend``; e.g. ``tcp://127.0.0.1:<port>``)
before the model is built, because layers size their shards at construction; it joins the
process group and splits the ranks, stage-major, into pipeline stages of
``tensor_parallel_size`` ranks each::

    world_size 4, tensor_parallel_size 2:   stage 0 = ranks 0, 1    stage 1 = ranks 2, 3
    rank = stage * tensor_parallel_size + tensor-parallel rank

Each stage is one tensor-parallel group (its own process group, or the default group when
there is one stage); a rank sends its stage's output to the rank of the same
tensor-parallel index in the next stage (``pp_send`` / ``pp_recv``).
``destroy_distributed()`` undoes it all.

Every op between ranks goes through a ``DeviceCommunicator`` (``distributed/communicator.py``):
the platform's (``Platform.make_device_communicator``), set by the worker with
``set_tp_communicator`` / ``set_pp_communicator``, else the torch.distributed default.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from halserve.distributed.communicator import DeviceCommunicator


@dataclass(frozen=True, slots=True)
class TensorParallelState:
    rank: int  # this process's index in the tensor-parallel group
    size: int  # ranks in the group
    group: Any = None  # torch.distributed ProcessGroup; None = the default group
    comm: Any = None  # (plugin API 1) the platform's faster all_reduce/all_gather for the tensors it supports(), if any
    device_comm: DeviceCommunicator | None = None  # this group's ops; None: torch.distributed (the default)


@dataclass(frozen=True, slots=True)
class PipelineParallelState:
    rank: int  # this process's stage
    size: int  # stages
    prev_rank: int | None = None  # global rank this stage receives from; None on the first stage
    next_rank: int | None = None  # global rank this stage sends to; None on the last stage
    comm: DeviceCommunicator | None = None  # the whole world's communicator (send/recv); None: torch.distributed

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1


_state = TensorParallelState(rank=0, size=1)
_pp_state = PipelineParallelState(rank=0, size=1)


def init_tensor_parallel(rank: int, size: int, group: Any = None) -> TensorParallelState:
    """Set this process's tensor-parallel rank and size (and process group)."""
    global _state
    if size < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"tensor parallel rank must be in [0, {size}), got {rank}")
    if size > 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ValueError(
            f"tensor parallel size {size} needs torch.distributed initialised first "
            "(torch.distributed.init_process_group with the platform's dist_backend)"
        )
    _state = TensorParallelState(rank=rank, size=size, group=group)
    return _state


def init_distributed(backend: str, init_method: str | None, rank: int, world_size: int,
                     timeout_s: float | None = None, tensor_parallel_size: int | None = None) -> TensorParallelState:
    """Join the ``world_size``-rank process group and split it into pipeline stages of
    ``tensor_parallel_size`` ranks (None: one stage, all ranks tensor-parallel).

    Called by each worker in ``init_device`` (one process per rank). ``init_method`` is a
    torch.distributed URL every rank can reach (``tcp://host:port``); None reads the
    ``env://`` variables (MASTER_ADDR, MASTER_PORT). Idempotent for the same rank/size.
    """
    import datetime

    global _pp_state
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} / world_size {world_size}: need 0 <= rank < world_size")
    tp = world_size if tensor_parallel_size is None else tensor_parallel_size
    if tp < 1 or world_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide world_size {world_size}")
    dist = torch.distributed
    if not dist.is_available():
        raise ValueError("torch.distributed is not available in this torch build; use tensor_parallel_size=1")
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise ValueError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not rank {rank} of {world_size}"
            )
    else:
        kwargs = {}
        if timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend=backend, init_method=init_method or "env://", rank=rank,
                                world_size=world_size, **kwargs)
    num_stages, stage = world_size // tp, rank // tp
    group = None  # one stage: the default group
    if num_stages > 1:
        for s in range(num_stages):  # (every rank creates every group, in the same order)
            stage_group = dist.new_group(list(range(s * tp, (s + 1) * tp)))
            if s == stage:
                group = stage_group
    _pp_state = PipelineParallelState(
        rank=stage, size=num_stages,
        prev_rank=rank - tp if stage > 0 else None,
        next_rank=rank + tp if stage < num_stages - 1 else None,
    )
    return init_tensor_parallel(rank % tp, tp, group=group)


def set_tp_communicator(comm: Any) -> None:
    """Use ``comm`` for this process's tensor-parallel ops: a ``DeviceCommunicator``
    (``Platform.make_device_communicator``) for every op, or (plugin API 1) an object with
    ``supports(x)``, ``all_reduce(x)``, ``all_gather(x, dim)`` (``Platform.make_tp_communicator``)
    tried first for the tensors it supports. None (a platform without a fast path) clears the fast path."""
    global _state
    if comm is None:
        _state = TensorParallelState(rank=_state.rank, size=_state.size, group=_state.group,
                                     device_comm=_state.device_comm)
    elif isinstance(comm, DeviceCommunicator):
        _state = TensorParallelState(rank=_state.rank, size=_state.size, group=_state.group, comm=_state.comm,
                                     device_comm=comm)
    else:
        _state = TensorParallelState(rank=_state.rank, size=_state.size, group=_state.group, comm=comm,
                                     device_comm=_state.device_comm)


def set_pp_communicator(comm: DeviceCommunicator | None) -> None:
    """Use ``comm`` (over the whole world: ``group`` None, global ranks) for the pipeline stages'
    ``send``/``recv``; None: torch.distributed."""
    global _pp_state
    if comm is not None and not isinstance(comm, DeviceCommunicator):
        raise TypeError(f"set_pp_communicator takes a DeviceCommunicator, got {type(comm).__name__}")
    s = _pp_state
    _pp_state = PipelineParallelState(rank=s.rank, size=s.size, prev_rank=s.prev_rank, next_rank=s.next_rank, comm=comm)


def get_tp_communicator() -> DeviceCommunicator:
    """This process's tensor-parallel communicator (the torch.distributed default when none was set)."""
    return _state.device_comm or DeviceCommunicator(_state.group, _state.rank, _state.size)


def get_pp_communicator() -> DeviceCommunicator:
    """The world communicator the pipeline stages send and receive through (default: torch.distributed)."""
    if _pp_state.comm is not None:
        return _pp_state.comm
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return DeviceCommunicator(None, dist.get_rank(), dist.get_world_size())
    return DeviceCommunicator(None, 0, 1)


def destroy_distributed() -> None:
    """Leave the process group (if any) and go back to a single rank. Idempotent."""
    destroy_tensor_parallel()
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def destroy_tensor_parallel() -> None:
    """Back to a single rank (tests, worker shutdown)."""
    global _state, _pp_state
    _state = TensorParallelState(rank=0, size=1)
    _pp_state = PipelineParallelState(rank=0, size=1)


def get_pp_state() -> PipelineParallelState:
    return _pp_state


@contextlib.contextmanager
def whole_model_stage() -> Iterator[None]:
    """Build a whole model on a pipeline stage (a draft model, which runs on the last stage only)."""
    global _pp_state
    saved, _pp_state = _pp_state, PipelineParallelState(rank=0, size=1)
    try:
        yield
    finally:
        _pp_state = saved


def pp_send(tensors: dict[str, torch.Tensor]) -> None:
    """Send this stage's output (e.g. hidden states and residual) to the next stage, in key order."""
    dst = _pp_state.next_rank
    if dst is None:
        raise RuntimeError("the last pipeline stage has no next stage to send to")
    comm = get_pp_communicator()
    for key in sorted(tensors):
        comm.send(tensors[key], dst=dst)


def pp_recv(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Receive the previous stage's output into ``tensors`` (allocated with the right shapes and
    dtypes: every stage knows the step's token count), in key order; returns them."""
    src = _pp_state.prev_rank
    if src is None:
        raise RuntimeError("the first pipeline stage has no previous stage to receive from")
    comm = get_pp_communicator()
    for key in sorted(tensors):
        comm.recv(tensors[key], src=src)
    return tensors


def get_tp_state() -> TensorParallelState:
    return _state


def get_tp_rank() -> int:
    return _state.rank


def get_tp_size() -> int:
    return _state.size


def get_tp_group() -> Any:
    return _state.group


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """Exact division for shard sizes; a remainder is a configuration mistake."""
    if numerator % denominator:
        raise ValueError(
            f"{what} {numerator} is not divisible by tensor parallel size {denominator}; "
            "pick a tensor_parallel_size that divides it"
        )
    return numerator // denominator


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks (no-op for one rank)."""
    if _state.size == 1:
        return x
    if _state.comm is not None and _state.comm.supports(x):
        return _state.comm.all_reduce(x)
    if _state.device_comm is not None:
        return _state.device_comm.all_reduce(x)
    torch.distributed.all_reduce(x, group=_state.group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order (no-op for one rank)."""
    if _state.size == 1:
        return x
    if _state.comm is not None and _state.comm.supports(x):
        return _state.comm.all_gather(x, dim)
    if _state.device_comm is not None:
        return _state.device_comm.all_gather(x, dim)
    parts = [torch.empty_like(x) for _ in range(_state.size)]
    torch.distributed.all_gather(parts, x.contiguous(), group=_state.group)
    return torch.cat(parts, dim=dim)


def tensor_model_parallel_all_to_all(x: torch.Tensor) -> torch.Tensor:
    """Chunk ``i`` of ``x`` (dim 0 split in ``size`` equal parts) to rank ``i``; the received chunks
    in rank order (``DeviceCommunicator.all_to_all``; expert parallelism). ``x`` for one rank."""
    if _state.size == 1:
        return x
    return get_tp_communicator().all_to_all(x)


def tensor_model_parallel_broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Tensor-parallel rank ``src``'s ``x`` on every rank (no-op for one rank)."""
    if _state.size == 1:
        return x
    return get_tp_communicator().broadcast(x, src)


__all__ = [
    "DeviceCommunicator",
    "PipelineParallelState",
    "TensorParallelState",
    "destroy_distributed",
    "destroy_tensor_parallel",
    "divide",
    "get_pp_communicator",
    "get_pp_state",
    "get_tp_group",
    "get_tp_rank",
    "get_tp_communicator",
    "get_tp_size",
    "get_tp_state",
    "init_distributed",
    "init_tensor_parallel",
    "pp_recv",
    "pp_send",
    "set_pp_communicator",
    "set_tp_communicator",
    "whole_model_stage",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_all_to_all",
    "tensor_model_parallel_broadcast",
]

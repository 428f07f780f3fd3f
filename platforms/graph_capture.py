"""How a platform records one decode step's forward once and replays it (``Platform.graph_capture``).

The model runner (``halserve.worker.step_graphs``) owns the static input buffers and calls
``capture(fn)`` once per padded batch size at start-up; ``fn`` runs the model on those
buffers. What ``capture`` returns is called instead of ``fn`` on each later decode step of
that size, after the runner has copied the step's inputs into the same buffers::

    replay = capture.capture(fn)   # start-up: fn ran (and was recorded) once
    ...                            # per step: copy inputs into fn's buffers, then
    hidden = replay()              # the same output tensor as at capture, holding this step's result

Implementations: ``CudaGraphCapture`` (CUDA graphs, HIP graphs on ROCm: the torch.cuda API of
either build) and ``EagerReplayCapture``, the reference, which runs ``fn`` again in Python (no
speed-up; it proves the runner's buffer plumbing on any device, the CPU tests use it).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # pragma: no cover
    import torch


class GraphCapture:
    """Records and replays one step's forward; one instance per model runner."""

    name: ClassVar[str]
    """Logged at start-up and shown by ``halserve plugins`` (the platform's ``graph_mode``)."""
    replays_python: ClassVar[bool] = False
    """True when a replay runs ``fn``'s Python again (any attention backend then works); False when
    it replays recorded device work only, so the attention backend must read every per-step value
    from the metadata's device tensors (``AttentionBackend`` subclasses say so with
    ``supports_graph_capture = True``)."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Run ``fn`` once, recording it; return the replay. ``fn`` has already run eagerly once
        (kernels compiled, workspaces allocated), so nothing in it may need a first-call setup."""
        raise NotImplementedError


class EagerReplayCapture(GraphCapture):
    """The reference: a replay calls ``fn`` again and copies its result into the tensor ``capture``
    returned, so the caller sees the same static output tensor as with a device graph."""

    name = "eager_replay"
    replays_python = True

    def __init__(self) -> None:
        self.num_replays = 0  # (tests: proof that steps went through the replay)

    def capture(self, fn):
        out = fn()

        def replay():
            self.num_replays += 1
            return out.copy_(fn())

        return replay


class CudaGraphCapture(GraphCapture):
    """torch.cuda graphs (CUDA graphs, or HIP graphs on a ROCm build of torch). Every graph of a
    runner shares one memory pool: the runner captures the largest batch first, and the smaller
    ones reuse its activations' memory (they never replay at the same time)."""

    name = "cuda_graphs"

    def __init__(self, device: Any, name: str | None = None) -> None:
        self.device = device
        self.pool: Any = None
        if name is not None:
            self.name = name

    def capture(self, fn):
        import torch

        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        torch.cuda.synchronize(self.device)

        def replay():
            graph.replay()
            return out

        return replay


__all__ = ["CudaGraphCapture", "EagerReplayCapture", "GraphCapture"]

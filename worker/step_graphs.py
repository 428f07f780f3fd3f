"""Decode steps replayed from graphs captured at start-up (the platform's ``graph_capture``).

Static buffers, allocated once at the largest captured size M; a graph of size B reads their
first B rows (and, for the block table, every column)::

    input_ids       [M]       the step's tokens, then 0
    positions       [M]       their positions, then 0
    slot_mapping    [M]       their slots, then PAD_SLOT (slot 0 of the null block 0)
    seq_lens        [M]       their context lengths, then 1
    query_start_loc [M + 1]   0 1 2 .. R, then R+1 .. B (one token per padding row)
    block_table     [M, max_blocks_per_req]   their block ids, then rows of 0 (the null block)

A padding row is a one-token request at position 0 that writes its K/V into the null block,
which the block pool never hands out (``core/kv_cache/block_pool.py``), and reads only that:
real requests are untouched. Only decode-only steps (every request one token, no drafts)
replay; prefill and mixed steps, and steps of more requests than the largest size, run eagerly.
Sampling stays outside the graph: it reads the replay's hidden states like the eager ones.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from halserve.worker.capture_sizes import capture_sizes, max_capture_size, padded_size

if TYPE_CHECKING:  # pragma: no cover
    from halserve.attention_backends.base import AttentionMetadata
    from halserve.platforms.base import Platform
    from halserve.platforms.graph_capture import GraphCapture
    from halserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

PAD_SLOT = 0  # slot 0 of the null block: where padding rows write their K/V


def why_eager(runner: ModelRunner) -> str | None:
    """Why this runner cannot replay graphs at all (None: it can, given a platform capture)."""
    config, info = runner.config, runner.info
    reasons = [
        (config.enforce_eager, "enforce_eager is set"),
        (runner.pp.size > 1, "pipeline parallelism (each stage receives its input from the one before)"),
        (config.tensor_parallel_size > 1, "tensor parallelism (its collectives are not captured yet)"),
        (config.enable_lora, "LoRA (per-step adapter indices)"),
        (config.speculative_config is not None, "speculative decoding (several query tokens per request)"),
        (config.kv_transfer_config is not None, "a KV connector (per-layer loads and saves)"),
        (info.is_multimodal or info.uses_mrope, "a vision-language model (image embeddings, M-RoPE positions)"),
        (info.runner == "pooling", "a classifier (it never decodes)"),
    ]
    return next((reason for hit, reason in reasons if hit), None)


class StepGraphs:
    """The captured decode steps of one model runner; ``replay`` runs a step through them."""

    def __init__(self, runner: ModelRunner, capture: GraphCapture, sizes: list[int]) -> None:
        self.runner = runner
        self.capture = capture
        self.sizes = sizes
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}
        m, dev = sizes[-1], runner.device
        self.input_ids = torch.zeros(m, dtype=torch.long, device=dev)
        self.positions = torch.zeros(m, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((m,), PAD_SLOT, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(m, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(m + 1, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros((m, runner.max_blocks_per_req), dtype=torch.int32, device=dev)
        self._arange = self.query_start_loc.clone()  # the padding rows' query_start_loc
        # host copies of seq_lens / query_start_loc, for backends that read them (Python replays only)
        self.seq_lens_cpu = torch.ones(m, dtype=torch.int32)
        self.query_start_loc_cpu = torch.arange(m + 1, dtype=torch.int32)

    # -- start-up ---------------------------------------------------------------------
    @classmethod
    def build(cls, runner: ModelRunner) -> StepGraphs | None:
        """Capture every size (largest first, so the smaller graphs reuse its memory), or None
        when this runner runs eagerly; logs which mode runs and why."""
        reason = why_eager(runner)
        capture = None if reason is not None else runner.platform.graph_capture()
        if reason is None and capture is None:
            reason = f"platform {runner.platform.name!r} captures no graphs (graph_mode {runner.platform.graph_mode})"
        backend = runner.attn_backend_cls
        if capture is not None and not capture.replays_python and not getattr(backend, "supports_graph_capture", False):
            reason = f"attention backend {backend.name!r} does not support graph capture"
            capture = None
        if capture is None:
            logger.info("decode steps run eagerly: %s", reason)
            return None
        graphs = cls(runner, capture, capture_sizes(max_capture_size(runner.config)))
        free_before = _free_memory(runner.platform)
        start = time.perf_counter()
        try:
            with runner.grad_mode():
                for size in reversed(graphs.sizes):
                    graphs._capture(size)
        except RuntimeError as exc:  # out of memory (torch.OutOfMemoryError), an op that cannot be captured
            logger.warning("graph capture failed at batch %d (%s: %s); decode steps run eagerly. Lower "
                           "--max-cudagraph-capture-size or --kv-cache-memory-fraction, or pass --enforce-eager",
                           size, type(exc).__name__, exc)
            del graphs
            runner.platform.empty_cache()
            return None
        used = None if free_before is None else free_before - (_free_memory(runner.platform) or 0)
        logger.info("graph mode %s: decode batches %s captured in %.1fs%s; larger and prefill steps run eagerly",
                    capture.name, _ranges(graphs.sizes), time.perf_counter() - start,
                    "" if used is None else f" ({used / (1 << 20):.0f} MiB)")
        return graphs

    def _capture(self, size: int) -> None:
        from halserve.forward_context import set_forward_context

        metadata = self.runner.attn_backend_cls.build_metadata(self._metadata(size))
        model, input_ids, positions = self.runner.model, self.input_ids[:size], self.positions[:size]

        def forward() -> torch.Tensor:
            with set_forward_context(metadata):
                return model(input_ids, positions, None)

        forward()  # eagerly first: kernels compile, workspaces are allocated outside the capture
        self.replays[size] = self.capture.capture(forward)

    def _metadata(self, size: int) -> AttentionMetadata:
        from halserve.attention_backends.base import AttentionMetadata

        return AttentionMetadata(
            num_actual_tokens=size,
            num_reqs=size,
            max_query_len=1,
            # the longest context a replay may see (a backend sizes its launch, e.g. split-K, by it)
            max_seq_len=self.runner.info.max_model_len,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            query_start_loc_cpu=self.query_start_loc_cpu[: size + 1],
            seq_lens_cpu=self.seq_lens_cpu[:size],
        )

    # -- per step ---------------------------------------------------------------------
    def replay(self, common: AttentionMetadata, input_ids: torch.Tensor, positions: torch.Tensor,
               **kwargs: Any) -> torch.Tensor | None:
        """Hidden states [num_reqs, hidden] of a decode-only step (``common`` with its tensors on the
        device), from the graph of its padded size; None when the step must run eagerly. The result
        is a view of the graph's output: read it before the next step."""
        num_reqs = common.num_reqs
        if kwargs or common.max_query_len != 1 or common.num_actual_tokens != num_reqs:
            return None
        size = padded_size(num_reqs, self.sizes)
        if size is None:
            return None
        r, width = num_reqs, common.block_table.shape[1]
        self.input_ids[:r].copy_(input_ids)
        self.input_ids[r:size].zero_()
        self.positions[:r].copy_(positions)
        self.positions[r:size].zero_()
        self.slot_mapping[:r].copy_(common.slot_mapping)
        self.slot_mapping[r:size].fill_(PAD_SLOT)
        self.seq_lens[:r].copy_(common.seq_lens)
        self.seq_lens[r:size].fill_(1)
        self.query_start_loc[: r + 1].copy_(common.query_start_loc)
        self.query_start_loc[r + 1 : size + 1].copy_(self._arange[r + 1 : size + 1])
        # (columns past a request's blocks may hold stale ids: the kernel reads only its seq_len's blocks)
        self.block_table[:r, :width].copy_(common.block_table)
        self.block_table[r:size].zero_()
        if self.capture.replays_python:
            self.seq_lens_cpu[:r].copy_(common.seq_lens_cpu)
            self.seq_lens_cpu[r:size].fill_(1)
            self.query_start_loc_cpu[: r + 1].copy_(common.query_start_loc_cpu)
            self.query_start_loc_cpu[r + 1 : size + 1] = torch.arange(r + 1, size + 1, dtype=torch.int32)
        return self.replays[size]()[:r]


def _free_memory(platform: Platform) -> int | None:
    try:
        platform.synchronize()
        return platform.memory_info()[0]
    except NotImplementedError:
        return None


def _ranges(sizes: list[int]) -> str:
    return f"{sizes}" if len(sizes) <= 6 else f"[{', '.join(map(str, sizes[:4]))}, ..., {sizes[-1]}] ({len(sizes)})"


__all__ = ["PAD_SLOT", "StepGraphs", "why_eager"]

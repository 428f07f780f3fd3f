"""The decode batch sizes captured as graphs, and which one a step pads up to (vLLM's
``cudagraph_capture_sizes``).

    ladder (max 64):  1 2 4 8 16 24 32 40 48 56 64
    a decode step of 13 requests replays the graph of 16: rows 13..15 are padding
    a step of 65 requests (past the largest) runs eagerly

Steps of 8 and up pad by at most 7 rows (16 past 256, where the ladder widens): a padded
row costs its share of the GEMMs, which at these sizes are bound by reading the weights,
not by the rows.
"""
from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig

DEFAULT_MAX_CAPTURE_SIZE = 512  # vLLM's default largest captured batch
_FINE_STEP, _COARSE_STEP, _COARSE_FROM = 8, 16, 256


def capture_sizes(max_size: int) -> list[int]:
    """Ascending sizes up to and including ``max_size``: 1, 2, 4, then every 8 up to 256 and
    every 16 past it; ``max_size`` itself is always the last (so no step up to it runs eagerly)."""
    if max_size < 1:
        raise ValueError(f"the largest captured batch must be >= 1, got {max_size}")
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    sizes += range(_FINE_STEP, min(max_size, _COARSE_FROM) + 1, _FINE_STEP)
    sizes += range(_COARSE_FROM + _COARSE_STEP, max_size + 1, _COARSE_STEP)
    if sizes[-1] != max_size:
        sizes.append(max_size)
    return sizes


def max_capture_size(config: EngineConfig) -> int:
    """The largest batch worth capturing for ``config``: ``max_cudagraph_capture_size`` (default
    512), never past the most requests a step holds (``max_num_seqs``) nor the tokens it may
    schedule (``max_num_batched_tokens``: a decode step has one token per request)."""
    wanted = config.max_cudagraph_capture_size or DEFAULT_MAX_CAPTURE_SIZE
    return max(1, min(wanted, config.max_num_seqs, config.max_num_batched_tokens))


def padded_size(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``num_reqs`` rows; None past the largest (eager)."""
    if num_reqs < 1:
        raise ValueError(f"a decode step has at least one request, got {num_reqs}")
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


__all__ = ["DEFAULT_MAX_CAPTURE_SIZE", "capture_sizes", "max_capture_size", "padded_size"]

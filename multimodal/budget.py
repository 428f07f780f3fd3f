"""The scheduler's per-step budget of vision-encoder work (vLLM's encoder budget).

A step that reaches any placeholder token of an image makes the model runner encode the whole
image (``worker/mm_embeddings.py``), so a step whose chunks touch many images would encode all of
them at once: a long step and a spike of activation memory. The scheduler therefore gives each
step a budget of image tokens to encode (``max_num_batched_tokens``, the same bound as for the
decoder's tokens) and ends a request's chunk before an image that no longer fits; the first image
of a step always fits, so an image larger than the budget is still scheduled (alone).

Which images a chunk ``[start, end)`` makes the runner encode: those overlapping it that begin at
``start`` or later; and for a request the runner has just been sent whole (new, or resumed after
preemption, whose chunk may start inside an image after a prefix-cache hit) every overlapping one.
An image begun in an earlier step of a running request is held by the runner already.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from halserve.request import Request


def fit_encoder_budget(request: Request, start: int, num_new_tokens: int, budget_left: int, budget: int,
                       fresh: bool) -> tuple[int, int]:
    """``(num_new_tokens cut before the first image that does not fit, image tokens to encode)`` for
    ``request``'s chunk of ``num_new_tokens`` from ``start``; ``fresh``: the runner gets the request
    whole this step. ``budget_left`` of the step's ``budget`` remains."""
    features = request.mm_features
    if not features:
        return num_new_tokens, 0
    end, used = start + num_new_tokens, 0
    for feature in features:  # (in prompt order)
        if feature.offset >= end:
            break
        if feature.end <= start or (feature.offset < start and not fresh):
            continue  # fed already, or encoded in an earlier step
        alone = budget_left == budget and used == 0  # the step's first image always fits
        if used + feature.length > budget_left and not alone:
            return max(feature.offset - start, 0), used
        used += feature.length
    return num_new_tokens, used

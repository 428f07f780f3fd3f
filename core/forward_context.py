"""The per-step state layers read without it being threaded through every forward().

The model runner wraps each model call::

    with set_forward_context(attn_metadata):    # what the backend's build_metadata returned
        hidden = model(input_ids, positions)

and each ``Attention`` layer reads ``get_forward_context().attn_metadata``. ``None`` means a
dummy run (memory profiling, warm-up): attention layers skip the cache and return zeros.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from halserve.kv_connectors.base import KVConnector


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: Any  # backend metadata for this step, or None for a dummy run
    kv_connector: KVConnector | None = None  # the worker's KV connector when this step loads or saves blocks (per-layer hooks)
    # every request has one query token this step (a decode step): a kernel may pick its arithmetic by it, e.g.
    # the cpu GGUF kernel's one int8 activation level for decode rows however many (platforms/cpu_kernels/native_gguf.py)
    decode_only: bool = False


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(attn_metadata: Any, kv_connector: KVConnector | None = None,
                        decode_only: bool = False) -> Iterator[ForwardContext]:
    """Make ``attn_metadata`` (and the step's KV connector, and whether it is a decode step) visible to the
    layers for the duration of one model call. Nesting restores the outer context on exit."""
    global _current
    previous = _current
    _current = ForwardContext(attn_metadata=attn_metadata, kv_connector=kv_connector, decode_only=decode_only)
    try:
        yield _current
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    """The context of the model call in progress; raises outside ``set_forward_context``."""
    if _current is None:
        raise RuntimeError(
            "no forward context is set: call the model inside "
            "`with halserve.forward_context.set_forward_context(attn_metadata):` "
            "(attn_metadata=None for a dummy run)"
        )
    return _current


def in_decode_step() -> bool:
    """A model call of a decode step is in progress (``ForwardContext.decode_only``); False outside any."""
    return _current is not None and _current.decode_only


# Which rows of the logits being computed only feed an argmax (set by the model runner around its compute_logits
# call for the rows it samples): a function giving them, asked only by a head that can use the answer; its answer
# is kept for the call. None: no such knowledge, every logit must be the model's.
_argmax_rows: list = [None, None]  # [the function, or None; its answer once asked]
_NOT_ASKED = object()


@contextmanager
def set_argmax_rows(rows: Callable[[], list[bool] | None] | None) -> Iterator[None]:
    """Around one ``compute_logits`` call: ``rows()[i]`` True says row i's logits feed nothing but an argmax
    (greedy sampling, no logprobs, penalties, biases, masks or drafts: ``halserve.sampling.takes_argmax_only``), so
    a head may compute them more cheaply as long as each such row's first maximum is the token, and logit, it would
    have given (the cpu GGUF head: one int8 level with the near ties recomputed). ``rows`` is called at most once,
    and only by a head that asks (so other heads' steps do not pay for it). Nesting restores the outer value."""
    global _argmax_rows
    previous = _argmax_rows
    _argmax_rows = [rows, _NOT_ASKED]
    try:
        yield
    finally:
        _argmax_rows = previous


def argmax_only_rows() -> list[bool] | None:
    """The rows of the ``compute_logits`` call in progress that only feed an argmax (``set_argmax_rows``), or None."""
    rows_fn, answer = _argmax_rows
    if rows_fn is None:
        return None
    if answer is _NOT_ASKED:
        answer = _argmax_rows[1] = rows_fn()
    return answer


__all__ = ["ForwardContext", "argmax_only_rows", "get_forward_context", "in_decode_step", "set_argmax_rows",
           "set_forward_context"]

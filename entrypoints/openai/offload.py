"""Keeping big requests off the event loop: ``RequestOffloader``.

``json.loads``, pydantic's ``model_validate_json`` and the tokenizer's ``decode`` are single C
or Rust calls that hold the GIL for their whole run (0.5 s for a 24 MB body here), so a thread
cannot keep the event loop answering meanwhile; a process can. A body over ``INLINE_BYTES`` is
parsed and validated in a worker process (one per API server, spawned at start-up), which sends
the model back with its long token-id lists as int32 arrays (pickled as one bytes copy, not one
object per id); a thread turns them back into lists a slice at a time (the GIL changes hands
between slices). A large ``/detokenize`` runs whole in the worker: parse, range check, decode.
Small bodies are parsed inline (a few milliseconds at most).
"""
from __future__ import annotations

import asyncio
import importlib
import json
import os
import pickle
import signal
import sys
import threading
import time
from array import array
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from halserve.entrypoints.openai.errors import OpenAIError, parse_body

__all__ = ["RequestOffloader", "release_in_thread", "release_request_in_thread"]

INLINE_BYTES = 256 * 1024  # bodies up to this size are parsed on the event loop
_PACK_MIN_IDS = 256  # token-id lists this long travel as arrays
_UNPACK_SLICE = 65536  # ids turned back into a list per GIL-holding call
_RELEASE_DELAY_S = 0.2

_worker_tokenizer: Any = None  # (in the worker process) the model's tokenizer


class RequestOffloader:
    """Parses request bodies and serves large ``/detokenize`` calls off the event loop (see the
    module docstring). ``start`` spawns the worker; ``shutdown`` stops it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._pool: ProcessPoolExecutor | None = None

    def start(self) -> None:
        import multiprocessing

        if self._pool is not None:
            return
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_init_worker, initargs=(pickle.dumps(self.tokenizer), os.getpid()))
        self._pool.submit(int)  # (start it now, not under the first large request)

    def shutdown(self) -> None:
        """Stop the worker and wait for it (blocking: call it from a thread). Not waiting would race
        the interpreter's exit, which can close the pool's queue before the stop reaches the worker."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    async def parse(self, model: type, raw: bytes) -> Any:
        """``parse_body(model, raw)``: inline when small, else in the worker (same errors)."""
        if len(raw) <= INLINE_BYTES or self._pool is None:
            return parse_body(model, raw)
        loop = asyncio.get_running_loop()
        packed = await loop.run_in_executor(self._pool, _parse_packed, f"{model.__module__}:{model.__qualname__}", raw)
        return await loop.run_in_executor(None, _unpack, packed)

    async def detokenize(self, raw: bytes, vocab_size: int | None) -> tuple[str | None, bytes] | None:
        """A large /detokenize body: (the model it names, the JSON response body), both computed in
        the worker; None when the body is small (the caller does it inline)."""
        if len(raw) <= INLINE_BYTES or self._pool is None:
            return None
        loop = asyncio.get_running_loop()
        return _raise_error(await loop.run_in_executor(self._pool, _detokenize, raw, vocab_size))


# ---------------------------------------------------------------------- worker process
def _init_worker(tokenizer: bytes, parent_pid: int) -> None:
    global _worker_tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Ctrl-C reaches the whole group: the API server stops it)
    os.nice(10)  # parsing a big body may wait; the engine's steps and the event loop may not
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), name="halserve-parent-watch", daemon=True).start()
    _worker_tokenizer = pickle.loads(tokenizer)


def _exit_with_parent(parent_pid: int) -> None:
    """A killed API server leaves no worker behind (the pool's queue would keep it waiting)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def _parse_packed(model_path: str, raw: bytes) -> bytes:
    module, name = model_path.split(":")
    model = getattr(importlib.import_module(module), name)
    try:
        parsed = parse_body(model, raw)
    except OpenAIError as exc:
        return pickle.dumps(_error_tuple(exc), protocol=5)
    for field, value in list(parsed.__dict__.items()):
        packed = _pack_ids(value)
        if packed is not value:
            parsed.__dict__[field] = packed
    return pickle.dumps(("ok", parsed), protocol=5)


def _detokenize(raw: bytes, vocab_size: int | None) -> tuple:
    import numpy as np

    from halserve.entrypoints.openai.errors import BadRequestError
    from halserve.entrypoints.openai.tokenize_protocol import DetokenizeRequest

    try:
        req = parse_body(DetokenizeRequest, raw)
        ids = np.asarray(req.tokens, dtype=np.int64)
        bad = np.flatnonzero((ids < 0) | (ids >= vocab_size)) if vocab_size is not None else np.flatnonzero(ids < 0)
        if bad.size:
            i = int(bad[0])
            raise BadRequestError(f"token id {int(ids[i])} at position {i} is out of range: ids must be in "
                                  f"[0, {vocab_size})", param="tokens")
        body = json.dumps({"prompt": _worker_tokenizer.decode(req.tokens)}, ensure_ascii=False).encode()
    except OpenAIError as exc:
        return _error_tuple(exc)
    return "ok", (req.model, body)


def _error_tuple(exc: OpenAIError) -> tuple:
    return "error", exc.message, exc.param, exc.code, exc.status_code


def _pack_ids(value: Any) -> Any:
    """A long list of ints (or a list of such lists) as int32 arrays; anything else as it is."""
    if isinstance(value, list) and value:
        if isinstance(value[0], int) and len(value) >= _PACK_MIN_IDS and _fits_int32(value):
            return array("i", value)
        if isinstance(value[0], list) and all(isinstance(v, list) and (not v or isinstance(v[0], int))
                                              for v in value):
            if sum(len(v) for v in value) >= _PACK_MIN_IDS and all(_fits_int32(v) for v in value):
                return [array("i", v) for v in value]
    return value


def _fits_int32(ids: list) -> bool:
    return all(isinstance(i, int) and not isinstance(i, bool) and -2**31 <= i < 2**31 for i in ids)


# ---------------------------------------------------------------------- API-server side (a thread)
def _unpack(packed: bytes) -> Any:
    parsed = _raise_error(pickle.loads(packed))
    for field, value in list(parsed.__dict__.items()):
        if isinstance(value, array):
            parsed.__dict__[field] = _to_list(value)
        elif isinstance(value, list) and value and isinstance(value[0], array):
            parsed.__dict__[field] = [_to_list(v) for v in value]
    return parsed


def _to_list(ids: array) -> list[int]:
    if len(ids) <= _UNPACK_SLICE:
        return ids.tolist()
    out: list[int] = []
    for start in range(0, len(ids), _UNPACK_SLICE):
        out.extend(ids[start:start + _UNPACK_SLICE].tolist())
    return out


def _raise_error(result: tuple) -> Any:
    if result[0] == "error":
        _, message, param, code, status = result
        raise OpenAIError(message, param=param, code=code, status_code=status)
    return result[1]


def release_in_thread(values: list) -> None:
    """Empty ``values``, freeing what only it held (e.g. a big batch's token-id lists) in a thread:
    freeing millions of ints takes tens of milliseconds the event loop should not spend."""
    box = list(values)
    values.clear()
    if box:
        threading.Thread(target=_release, args=(box,), name="halserve-release", daemon=True).start()


def _release(box: list) -> None:
    time.sleep(_RELEASE_DELAY_S)  # (the loop drops its other references first, e.g. a traceback's frames)
    _free_in_slices(box)


def _free_in_slices(values: list) -> None:
    """Empty ``values`` a slice at a time. Freeing a list is one C call that holds the GIL until
    its last element is gone (90 ms for 3,000 prompts of 2,048 ids here), so a thread doing it in
    one go stalls the event loop as long; in slices the GIL changes hands between them. A nested
    list that nothing else holds is emptied the same way before it is dropped (one that something
    else still holds is only dropped: its contents are not ours to free)."""
    while values:
        last = values[-1]
        if isinstance(last, list) and len(last) > 1 and sys.getrefcount(last) <= 3:  # (values, last, the call)
            _free_in_slices(last)
            del last
            values.pop()
        else:
            del last
            del values[-_UNPACK_SLICE:]


def release_request_in_thread(request: Any) -> None:
    """``release_in_thread`` for a parsed request's long list fields (set to None: call it once the
    response no longer needs them)."""
    fields = [name for name, value in request.__dict__.items() if isinstance(value, list) and len(value) >= 64]
    release_in_thread([request.__dict__.pop(name) for name in fields])
    for name in fields:
        request.__dict__[name] = None

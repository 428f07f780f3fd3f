"""EngineThread: the one thread that touches an EngineCore (AsyncLLM's right-hand column).

    asyncio loop (AsyncLLM)                        engine thread
    -----------------------                        -------------
    add_requests ---- ("add", core requests) --->  EngineCore.add_request
                 <--- ack: None or the ValueError
    abort        ---- ("abort", child ids) ----->  EngineCore.abort_requests
    call         ---- ("call", fn) ------------->  fn(engine_core) (call_fn), core.<method>(*args) (call)
                 <--- ack: its result or exception
    stop         ---- ("stop") ----------------->  leave the loop, EngineCore.shutdown
                                                   while work: step(), publish stats
    on_outputs   <--- call_soon_threadsafe(outputs)
    on_dead      <--- call_soon_threadsafe(exc)    (the thread died)

The thread blocks on its input queue when idle (no busy-spinning). Commands are applied in
the order they were queued, between steps. ``stats`` is the snapshot the thread publishes
after every step.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from halserve.engine.core_client import EngineCoreClient
from halserve.engine.types import EngineStats

if TYPE_CHECKING:  # pragma: no cover
    from halserve.engine.core import EngineCore

logger = logging.getLogger(__name__)

__all__ = ["EngineThread"]


class EngineThread(EngineCoreClient):
    """Runs an ``EngineCore`` in its own thread, fed by a command queue (see the module docstring):
    the in-process ``EngineCoreClient``.

    ``AsyncLLM`` owns one: it calls ``start`` inside its event loop, queues work with
    ``add_requests`` / ``abort`` / ``call`` / ``stop``, and gets each step's outputs and the
    thread's death through ``on_outputs`` / ``on_dead``, which run on that loop.
    """

    def __init__(
        self,
        engine_core: EngineCore,
        on_outputs: Callable[[list[Any]], None] | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine_core = engine_core
        self.model_info = getattr(engine_core, "model_info", None)
        self.on_outputs = on_outputs
        self.on_dead = on_dead
        self.stats = EngineStats()
        self.loop: asyncio.AbstractEventLoop | None = None  # set by start(); None before
        self._thread: threading.Thread | None = None
        self._input: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._pending_acks: set[asyncio.Future] = set()
        try:
            self.stats = engine_core.get_stats()
        except Exception:  # noqa: BLE001 - stats are best effort before start
            pass

    # ------------------------------------------------------------------ asyncio side
    def bind(self, on_outputs: Callable[[list[Any]], None], on_dead: Callable[[BaseException], None]) -> None:
        self.on_outputs, self.on_dead = on_outputs, on_dead

    def start(self) -> None:
        """Start the thread, bound to the running event loop (idempotent)."""
        if self._thread is not None:
            return
        self.loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="halserve-engine", daemon=True)
        self._thread.start()

    async def stop(self, timeout: float) -> None:
        """Stop the thread after the commands already queued, waiting up to ``timeout`` seconds;
        the core is shut down either way (by the thread, or here if it never started)."""
        self._input.put(("stop", None))
        thread = self._thread
        if thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, thread.join, timeout)
            if thread.is_alive():
                logger.warning("engine thread did not stop within %.0fs", timeout)
        else:
            self._shutdown_core()

    async def add_requests(self, core_requests: list[Any]) -> BaseException | None:
        """Add ``core_requests`` to the core, all or none; returns the core's refusal (a
        ``ValueError``) or None, or what ``fail_pending`` was given meanwhile."""
        return await self._send("add", core_requests)

    def abort(self, child_ids: Iterable[str]) -> None:
        """Queue an abort of these core request ids (ids the core no longer has are ignored)."""
        self._input.put(("abort", list(child_ids)))

    async def call_fn(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(engine_core)`` in the thread, between steps; its result, or its exception raised here."""
        result = await self._send("call", fn)
        if isinstance(result, BaseException):
            raise result
        return result

    async def call(self, method: str, *args: Any) -> Any:
        return await self.call_fn(lambda core: getattr(core, method)(*args))

    def call_sync(self, method: str, *args: Any) -> Any:
        """Only before ``start`` (the thread is the core's only user once it runs)."""
        if self._thread is not None:
            raise RuntimeError("call_sync after the engine thread started; use call")
        return getattr(self.engine_core, method)(*args)

    def close_sync(self) -> None:
        if self._thread is None:
            self._shutdown_core()

    def fail_pending(self, error: BaseException) -> None:
        """Answer every ``add_requests`` / ``call`` still waiting with ``error`` (the thread died)."""
        for ack in list(self._pending_acks):
            _resolve(ack, error)

    async def _send(self, kind: str, payload: Any) -> Any:
        ack: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending_acks.add(ack)
        self._input.put((kind, (payload, ack)))
        try:
            return await ack
        finally:
            self._pending_acks.discard(ack)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        core = self.engine_core
        try:
            while True:
                block = not core.has_unfinished_requests()
                if self._drain_input(block=block):
                    break
                if core.has_unfinished_requests():
                    outputs = core.step()
                    # Published from this thread only, so a newer snapshot is never
                    # overwritten by an older one still queued for the event loop.
                    self.stats = core.get_stats()
                    if outputs:
                        self._call_in_loop(self.on_outputs, outputs)
                else:
                    self.stats = core.get_stats()
        except BaseException as exc:  # noqa: BLE001 - report to every stream, never hang them
            logger.exception("engine thread died")
            self._call_in_loop(self.on_dead, exc)
        finally:
            self._shutdown_core()

    def _drain_input(self, block: bool) -> bool:
        """Apply queued adds/aborts/calls; returns True on "stop"."""
        core = self.engine_core
        while True:
            try:
                kind, payload = self._input.get(block=block)
            except queue.Empty:
                return False
            block = False
            if kind == "stop":
                return True
            if kind == "abort":
                core.abort_requests(payload)
            elif kind == "call":  # the result, or the exception, goes back
                fn, ack = payload
                try:
                    result = fn(core)
                except Exception as exc:  # noqa: BLE001 - the caller's to handle
                    result = exc
                self._call_in_loop(_resolve, ack, result)
            elif kind == "add":
                requests, ack = payload
                error: BaseException | None = None
                added: list[str] = []
                try:
                    for req in requests:
                        core.add_request(req)
                        added.append(req.request_id)
                except ValueError as exc:
                    exc.request_id = req.request_id  # type: ignore[attr-defined]  # (which one: see submit_all)
                    error = exc
                    if added:
                        core.abort_requests(added)
                self._call_in_loop(_resolve, ack, error)

    def _shutdown_core(self) -> None:
        try:
            self.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - shutting down anyway
            logger.exception("engine core shutdown failed")


def _resolve(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)

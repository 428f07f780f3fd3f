"""How ``AsyncLLM`` reaches its ``EngineCore``: one interface, two implementations.

- ``EngineThread`` (engine_thread.py): the core steps in a thread of this process (tests,
  ``--disable-frontend-multiprocessing``).
- ``MPEngineCoreClient`` (here): the core steps in its own process (core_proc.py), reached
  over a Unix socket in the frames of serial.py; ``halserve serve``'s default. A reader thread
  turns the engine's frames into ``on_outputs`` / ``on_dead`` calls on the event loop, a writer
  thread sends, so a slow or stopped engine never blocks the loop. The engine process dying
  closes the socket: the reader sees it at once and every stream fails.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import queue
import shutil
import socket
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from halserve.engine.request_stream import EngineDeadError, EngineStoppedError
from halserve.engine.serial import FrameReader, decode_outputs, decode_stats, encode_request, pack
from halserve.engine.types import EngineStats

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig
    from halserve.models.loader import ModelInfo

logger = logging.getLogger(__name__)

__all__ = ["EngineCoreClient", "EngineCoreStartError", "MPEngineCoreClient", "start_engine_core_process"]


class EngineCoreStartError(RuntimeError):
    """The engine-core process could not start; ``is_bad_config``: the configuration is at fault (a ValueError)."""

    def __init__(self, message: str, is_bad_config: bool = False) -> None:
        super().__init__(message)
        self.is_bad_config = is_bad_config


class EngineCoreClient(ABC):
    """What ``AsyncLLM`` needs from its engine core, wherever it runs.

    ``bind`` once (callbacks run on the event loop), ``start`` inside the loop; then
    ``add_requests`` / ``abort`` / ``call`` until ``stop``. ``stats`` is the latest snapshot.
    """

    model_info: ModelInfo | None = None  # the core's
    stats: EngineStats
    # whether the core's process keeps the served LoRA adapters' names (``lora_register`` and the others
    # of engine/lora_names.py, ``on_loras``): with several API servers it must
    shares_lora_names: bool = False
    loop: asyncio.AbstractEventLoop | None = None  # the event loop ``start`` bound (callbacks run there)

    @abstractmethod
    def bind(self, on_outputs: Callable[[list[Any]], None], on_dead: Callable[[BaseException], None]) -> None:
        """Where each step's outputs (a list of EngineCoreOutput) and the core's death go."""

    @abstractmethod
    def start(self) -> None:
        """Bind to the running event loop and start delivering (idempotent)."""

    @abstractmethod
    async def add_requests(self, core_requests: list[Any]) -> BaseException | None:
        """Add these requests, all or none; the core's refusal (a ValueError) or None."""

    @abstractmethod
    def abort(self, child_ids: Iterable[str]) -> None:
        """Abort these core request ids (ids the core no longer has are ignored)."""

    @abstractmethod
    async def call(self, method: str, *args: Any) -> Any:
        """``core.<method>(*args)`` between steps; its result, or its exception raised here."""

    @abstractmethod
    def call_sync(self, method: str, *args: Any) -> Any:
        """``call`` from a thread that is not the event loop's (e.g. before the server starts)."""

    @abstractmethod
    def fail_pending(self, error: BaseException) -> None:
        """Answer every ``add_requests`` / ``call`` still waiting with ``error``."""

    @abstractmethod
    async def stop(self, timeout: float) -> None:
        """Stop the core after what is queued, waiting up to ``timeout`` seconds."""

    def close_sync(self) -> None:
        """(optional) Release the core without an event loop (a failed start-up). Default: nothing."""
        return None

    def _call_in_loop(self, fn: Callable[..., None] | None, *args: Any) -> None:
        """Run ``fn(*args)`` on the bound event loop from another thread (dropped when there is no
        callback, or no loop any more: nobody is left to tell)."""
        loop = self.loop
        if fn is None or loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed between the check and the call
            pass


def start_engine_core_process(config: EngineConfig, log_level: int = logging.WARNING) -> MPEngineCoreClient:
    """Spawn the engine-core process for ``config`` (it loads the model) and connect to it.
    ``EngineCoreStartError`` when it cannot start (its message says why)."""
    process, socket_path, model_info = spawn_engine_core(config, log_level)
    return MPEngineCoreClient(socket_path, model_info, process)


def spawn_engine_core(config: EngineConfig, log_level: int = logging.WARNING) -> tuple[Any, str, Any]:
    """Spawn the engine-core process; (process, its socket path, its ModelInfo) once it is ready."""
    import multiprocessing
    from multiprocessing.connection import wait

    from halserve.engine.core_proc import run_engine_core

    ctx = multiprocessing.get_context("spawn")
    socket_dir = tempfile.mkdtemp(prefix="halserve-engine-")
    socket_path = os.path.join(socket_dir, "core.sock")
    receiver, sender = ctx.Pipe(duplex=False)
    # (not a daemon: the core's executor may start worker processes of its own)
    process = ctx.Process(target=run_engine_core, args=(config, socket_path, sender, os.getpid(), log_level),
                          name="halserve-engine-core")
    process.start()
    sender.close()
    try:
        wait([receiver, process.sentinel])
        try:
            message = receiver.recv()
        except EOFError:
            process.join(5)
            raise EngineCoreStartError(f"the engine-core process exited with code {process.exitcode} before it "
                                       "was ready (its log above says why)") from None
        if message[0] == "error":
            process.join(10)
            raise EngineCoreStartError(message[1], is_bad_config=message[2])
    except BaseException:
        if process.is_alive():
            process.terminate()
            process.join(5)
        shutil.rmtree(socket_dir, ignore_errors=True)
        raise
    finally:
        receiver.close()
    return process, socket_path, message[1]


class MPEngineCoreClient(EngineCoreClient):
    """The client of an engine-core process (see the module docstring). ``process``: the
    engine's ``multiprocessing.Process`` when this client owns it (stops and reaps it), None
    when another process does (``--api-server-count``)."""

    shares_lora_names = True

    def __init__(self, socket_path: str, model_info: ModelInfo, process: Any = None) -> None:
        self.socket_path = socket_path
        self.model_info = model_info
        self.process = process
        self.stats = EngineStats()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._on_outputs: Callable[[list[Any]], None] | None = None
        self._on_dead: Callable[[BaseException], None] | None = None
        self._dead: BaseException | None = None
        self._stopping = False
        self._acks: dict[int, concurrent.futures.Future] = {}
        self._ack_ids = itertools.count()
        # the adapters the engine-core process serves by name (lora_names.py): the latest list, and who hears it
        self.loras: list[Any] = []
        self._on_loras: Callable[[list[Any]], None] | None = None
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(socket_path)
        self._reader = threading.Thread(target=self._read_loop, name="halserve-core-reader", daemon=True)
        self._writer = threading.Thread(target=self._write_loop, name="halserve-core-writer", daemon=True)
        self._reader.start()
        self._writer.start()

    # ------------------------------------------------------------------ interface
    def bind(self, on_outputs: Callable[[list[Any]], None], on_dead: Callable[[BaseException], None]) -> None:
        self._on_outputs, self._on_dead = on_outputs, on_dead

    def start(self) -> None:
        if self.loop is not None:
            return
        self.loop = asyncio.get_running_loop()
        if self._dead is not None:  # died before the loop was there to hear it
            self._call_in_loop(self._on_dead, self._dead)

    async def add_requests(self, core_requests: list[Any]) -> BaseException | None:
        return await asyncio.wrap_future(self._request("add", [encode_request(r) for r in core_requests]))

    def abort(self, child_ids: Iterable[str]) -> None:
        ids = list(child_ids)
        if ids and self._dead is None:
            self._outbox.put(pack(("abort", ids)))

    async def call(self, method: str, *args: Any) -> Any:
        return _raise_or_return(await asyncio.wrap_future(self._request("call", method, args)))

    def call_sync(self, method: str, *args: Any) -> Any:
        return _raise_or_return(self._request("call", method, args).result())

    def on_loras(self, callback: Callable[[list[Any]], None]) -> None:
        """Have ``callback(list of LoRARequest)`` called with the served adapters, now and whenever they
        change (then on the reader thread)."""
        with self._lock:
            self._on_loras = callback
            callback(self.loras)

    def fail_pending(self, error: BaseException) -> None:
        with self._lock:
            acks, self._acks = self._acks, {}
        for ack in acks.values():
            if not ack.done():
                ack.set_result(error)

    async def stop(self, timeout: float) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._stop, timeout)

    def close_sync(self) -> None:
        self._stop(10.0)

    # ------------------------------------------------------------------ internals
    def _request(self, kind: str, *payload: Any) -> concurrent.futures.Future:
        ack: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._dead is not None:
                ack.set_result(EngineDeadError(f"the engine died: {self._dead}"))
                return ack
            ack_id = next(self._ack_ids)
            self._acks[ack_id] = ack
        self._outbox.put(pack((kind, ack_id, *payload)))
        return ack

    def _stop(self, timeout: float) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self.process is not None:
            self._outbox.put(pack(("shutdown",)))
        self._outbox.put(None)
        self._writer.join(timeout)
        process = self.process
        if process is None:  # another process owns the engine: just leave it
            self.sock.close()
            return
        process.join(timeout if self._dead is None else 1.0)  # (a dead engine's process is only exiting)
        if process.is_alive():
            logger.warning("the engine-core process did not stop within %.0fs: terminating it", timeout)
            process.terminate()
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join(5)
        self.sock.close()
        shutil.rmtree(os.path.dirname(self.socket_path), ignore_errors=True)

    def _write_loop(self) -> None:
        while True:
            frame = self._outbox.get()
            if frame is None:
                if self.process is None:
                    try:
                        self.sock.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                return
            try:
                self.sock.sendall(frame)
            except OSError:  # the reader reports the death
                return

    def _read_loop(self) -> None:
        reader = FrameReader(self.sock)
        reason = None
        stopped = None
        while True:
            messages = reader.read()
            if messages is None:
                break
            for message in messages:
                kind = message[0]
                if kind == "outputs":
                    outputs = decode_outputs(message[1])
                    self.stats = decode_stats(message[2])
                    self._call_in_loop(self._on_outputs, outputs)
                elif kind == "stats":
                    self.stats = decode_stats(message[1])
                elif kind == "loras":
                    with self._lock:
                        self.loras = message[2]
                        if self._on_loras is not None:
                            self._on_loras(self.loras)
                elif kind == "ack":
                    with self._lock:
                        ack = self._acks.pop(message[1], None)
                    if ack is not None and not ack.done():
                        ack.set_result(message[2])
                elif kind == "dead":
                    reason = message[1]
                elif kind == "stopped":
                    stopped = message[1]
        if self._stopping:
            return
        if stopped is not None and reason is None:
            self._die(EngineStoppedError(stopped))
            return
        if reason is None:
            reason = "the engine-core process exited"
            if self.process is not None:
                self.process.join(0.5)
                if self.process.exitcode is not None:
                    reason += f" with code {self.process.exitcode}"
        self._die(EngineDeadError(reason))

    def _die(self, error: BaseException) -> None:
        if isinstance(error, EngineStoppedError):
            logger.warning("engine core stopped: %s", error)
        else:
            logger.error("engine core died: %s", error)
        with self._lock:
            self._dead = error
        self.fail_pending(EngineDeadError(f"the engine died: {error}"))
        self._call_in_loop(self._on_dead, error)



def _raise_or_return(result: Any) -> Any:
    if isinstance(result, BaseException):
        raise result
    return result

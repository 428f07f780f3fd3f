"""The engine-core process: an ``EngineCore`` stepping in a process of its own (vLLM V1's
``EngineCoreProc``), serving one or more API-server processes over a Unix socket.

    API server(s)                                     engine-core process
    -------------                                     -------------------
    MPEngineCoreClient --- add / abort / call ------>  busy loop:
                       <-- outputs + stats per step --   poll sockets (block only when idle)
                       <-- ack / dead -----------------  apply adds, aborts, calls
                                                         step(); route outputs to their client

Outputs go to the client that added the request; every client gets the stats (``/metrics`` of
each API server reports the one engine). The process exits when told to (``shutdown``), on
SIGTERM (telling every client ``stopped`` first), once its last client has gone, or when its
parent dies; a step that raises tells every client ``dead`` and exits 1, as does a worker found
dead while idle (``check_health`` each poll). SIGINT is ignored: the API server drains first, then
stops it.
"""
from __future__ import annotations

import logging
import os
import selectors
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from halserve.engine.lora_names import LORA_NAME_METHODS, SharedLoRANames
from halserve.engine.serial import FrameReader, decode_request, encode_outputs, encode_stats, pack

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig
    from halserve.engine.core import EngineCore

logger = logging.getLogger(__name__)

__all__ = ["EngineCoreProc", "run_engine_core"]

# What a client may call on the core by name (``("call", ack, method, args)``).
UTILITY_METHODS = frozenset({"add_lora", "remove_lora", "list_loras", "hold_lora", "get_stats",
                             "sleep", "wake_up", "is_sleeping", "reset_prefix_cache", "update_weights",
                             "collective_rpc"})
STATS_INTERVAL_S = 0.05  # a client that got no outputs hears the stats at most this often while busy
IDLE_POLL_S = 1.0  # how long an idle loop blocks (then checks that its parent lives)


def run_engine_core(config: EngineConfig, socket_path: str, ready: Any, parent_pid: int,
                    log_level: int = logging.WARNING) -> None:
    """The process's entry point (multiprocessing spawn): build the core, bind ``socket_path``,
    report ``("ready", model_info)`` or ``("error", message, is_bad_config)`` on the pipe
    ``ready``, then serve until told to stop."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s engine-core: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append("SIGTERM"))
    from halserve.engine.core import EngineCore

    try:
        core = EngineCore(config)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which prints it
        ready.send(("error", f"{type(exc).__name__}: {exc}", isinstance(exc, ValueError)))
        ready.close()
        raise SystemExit(1) from None
    if os.getppid() != parent_pid:  # (the parent died while the model loaded)
        core.shutdown()
        raise SystemExit(1)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    ready.send(("ready", core.model_info))
    ready.close()
    proc = EngineCoreProc(core, listener, parent_pid, stopping)
    code = proc.run()
    logging.shutdown()
    # (the core is shut down and the sockets closed: skip the interpreter's slow teardown of torch)
    os._exit(code)


@dataclass(eq=False)
class _Client:
    sock: socket.socket
    reader: FrameReader
    request_ids: set[str] = field(default_factory=set)  # core ids of its unfinished requests
    last_stats: float = 0.0  # when it last heard the stats (time.monotonic)


class EngineCoreProc:
    """The busy loop (see the module docstring). ``run`` returns the process's exit code."""

    def __init__(self, core: EngineCore, listener: socket.socket, parent_pid: int | None = None,
                 stopping: list | None = None) -> None:
        self.core = core
        self.listener = listener
        self.parent_pid = parent_pid
        self.stopping = stopping if stopping is not None else []
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ)
        # a signal (SIGTERM) wakes an idle select at once: its handler's byte lands on this pair
        self._wakeup, wakeup_writer = socket.socketpair()
        self._wakeup.setblocking(False)
        wakeup_writer.setblocking(False)
        self._wakeup_writer = wakeup_writer
        self.selector.register(self._wakeup, selectors.EVENT_READ)
        try:
            signal.set_wakeup_fd(wakeup_writer.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main thread (tests): the idle poll's timeout bounds the delay
            pass
        self.clients: dict[socket.socket, _Client] = {}
        self.owner: dict[str, _Client] = {}  # core request id -> the client that added it
        self.had_client = False
        self.executor = getattr(core, "executor", None)  # (its check_health raises once a worker died)
        self.lora_names = SharedLoRANames(core)  # the API servers' adapters by name (engine/lora_names.py)

    def run(self) -> int:
        core = self.core
        code = 0
        try:
            while not self.stopping:
                busy = core.has_unfinished_requests()
                self._poll(0 if busy else IDLE_POLL_S)
                if self.stopping or (self.had_client and not self.clients):
                    break
                if not busy and self.parent_pid is not None and os.getppid() != self.parent_pid:
                    logger.warning("the parent process is gone: exiting")
                    break
                if not busy and self.executor is not None:  # (a worker that died while idle: known within a poll)
                    self.executor.check_health()
                if core.has_unfinished_requests():
                    self._send_outputs(core.step())
                elif busy:  # just went idle: everyone hears the final stats
                    self._send_outputs([])
            if "SIGTERM" in self.stopping:  # (an orderly stop: the API servers tell it from a crash)
                logger.info("received SIGTERM: stopping")
                self._broadcast(pack(("stopped", "the engine-core process received SIGTERM")))
        except BaseException as exc:  # noqa: BLE001 - every client hears it, then the process exits 1
            logger.exception("engine core died")
            self._broadcast(pack(("dead", f"{type(exc).__name__}: {exc}")))
            code = 1
        finally:
            try:
                core.shutdown()
            except Exception:  # noqa: BLE001 - exiting anyway
                logger.exception("engine core shutdown failed")
            for client in list(self.clients.values()):
                client.sock.close()
            self.listener.close()
        return code

    # ------------------------------------------------------------------ input
    def _poll(self, timeout: float) -> None:
        for key, _ in self.selector.select(timeout):
            sock = key.fileobj
            if sock is self._wakeup:
                try:
                    sock.recv(4096)
                except BlockingIOError:
                    pass
                continue
            if sock is self.listener:
                conn, _ = self.listener.accept()
                new = self.clients[conn] = _Client(conn, FrameReader(conn))
                self.selector.register(conn, selectors.EVENT_READ)
                self.had_client = True
                self._reply(new, ("loras", *self.lora_names.lora_snapshot()))  # (before it can ask anything)
                continue
            client = self.clients.get(sock) if isinstance(sock, socket.socket) else None
            if client is None:
                continue
            messages = client.reader.read()
            if messages is None:
                self._drop_client(client)
                continue
            for message in messages:
                self._handle(client, message)

    def _handle(self, client: _Client, message: tuple) -> None:
        kind = message[0]
        if kind == "abort":
            self._abort(client, message[1])
        elif kind == "add":
            _, ack, requests = message
            self._reply(client, ("ack", ack, self._add(client, [decode_request(r) for r in requests])))
        elif kind == "call":
            _, ack, method, args = message
            try:
                if method in LORA_NAME_METHODS:
                    version = self.lora_names.version
                    result = getattr(self.lora_names, method)(*args)
                    if self.lora_names.version != version:  # every API server hears it before the caller's ack
                        self._broadcast(pack(("loras", *self.lora_names.lora_snapshot())))
                elif method in UTILITY_METHODS:
                    result = getattr(self.core, method)(*args)
                else:
                    raise ValueError(f"unknown engine method {method!r}")
            except Exception as exc:  # noqa: BLE001 - the caller's to handle
                result = exc
            self._reply(client, ("ack", ack, result))
        elif kind == "shutdown":
            self.stopping.append("shutdown")
        else:
            logger.error("unknown message %r from a client", kind)

    def _add(self, client: _Client, requests: list) -> BaseException | None:
        """All or none: the core's refusal (a ValueError carrying the refused ``request_id``) undoes the
        ones added before it."""
        added: list[str] = []
        try:
            for req in requests:
                if req.request_id in self.owner:
                    raise ValueError(f"request id {req.request_id!r} is already in flight; use a unique id")
                self.lora_names.check(req.lora_request)
                self.core.add_request(req)
                added.append(req.request_id)
                self.owner[req.request_id] = client
                client.request_ids.add(req.request_id)
        except ValueError as exc:
            exc.request_id = req.request_id  # type: ignore[attr-defined]  # (which one: the client names its prompt)
            self._abort(client, added)
            return exc
        return None

    def _abort(self, client: _Client, request_ids: list[str]) -> None:
        mine = [rid for rid in request_ids if self.owner.get(rid) is client]
        for rid in mine:
            del self.owner[rid]
            client.request_ids.discard(rid)
        if mine:
            self.core.abort_requests(mine)

    def _drop_client(self, client: _Client) -> None:
        """The client went away: its requests are aborted."""
        self.selector.unregister(client.sock)
        del self.clients[client.sock]
        client.sock.close()
        self._abort(client, list(client.request_ids))

    # ------------------------------------------------------------------ output
    def _send_outputs(self, outputs: list) -> None:
        stats = encode_stats(self.core.get_stats())
        per_client: dict[_Client, list] = {}
        for out in outputs:
            client = self.owner.get(out.request_id)
            if client is None:  # aborted meanwhile
                continue
            per_client.setdefault(client, []).append(out)
            if out.finish_reason is not None:
                del self.owner[out.request_id]
                client.request_ids.discard(out.request_id)
        now = time.monotonic()
        idle = not self.core.has_unfinished_requests()
        for client in list(self.clients.values()):
            mine = per_client.get(client)
            if mine:
                self._reply(client, ("outputs", encode_outputs(mine), stats))
            elif idle or now - client.last_stats >= STATS_INTERVAL_S:
                self._reply(client, ("stats", stats))
            else:
                continue
            client.last_stats = now

    def _reply(self, client: _Client, message: tuple) -> None:
        try:
            client.sock.sendall(pack(message))
        except OSError:  # it went away; its requests are aborted
            if client.sock in self.clients:
                self._drop_client(client)

    def _broadcast(self, frame: bytes) -> None:
        for client in list(self.clients.values()):
            try:
                client.sock.sendall(frame)
            except OSError:
                pass

"""``P2pConnector``: disaggregated prefill without shared storage; the decode engine pulls the
prompt's K/V from the prefill engine over TCP.

Producer (``kv_role`` ``kv_producer``, listening on ``kv_ip:kv_port``): the OffloadingConnector's
host pool, written through as blocks are computed. Its scheduler side answers lookups (which rows
hold these keys) on ``kv_port``; each worker serves its pool rows on a port of its own.

Consumer (``kv_consumer``, extra config ``"peer": "host:port"``, the producer's ``kv_port``): its
scheduler side asks the producer, for each admitted request, how many of its blocks it holds (one
round trip); its workers fetch those rows from the producer's worker of the same rank and check
that each still holds the key asked for. A row reused meanwhile, a producer gone or of another
layout is a failed load: the request is recomputed. An unreachable producer means no hits (retried
after ``RETRY_S``), never an error.

Messages are length-prefixed: ``<u32 header length><u64 payload length><JSON header><payload>``.
Bind ``kv_ip`` to an interface your decode engines reach (default 127.0.0.1: this machine only);
the port serves K/V to whoever connects, so keep it inside your cluster network.
"""
from __future__ import annotations

import json
import logging
import socket
import socketserver
import struct
import threading
import time
from typing import TYPE_CHECKING, Any

from halserve.kv_connectors.base import KVConnector
from halserve.kv_connectors.offloading import OffloadingConnector, check_pool_config

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig
    from halserve.kv_connectors.base import BlockTransfer, KVCacheAccess, KVTransferConfig

logger = logging.getLogger(__name__)
RETRY_S = 5.0  # after a failed lookup, how long the consumer assumes the producer is away
TIMEOUT_S = 30.0


def send_message(sock: socket.socket, header: dict, payload: bytes = b"") -> None:
    data = json.dumps(header).encode()
    sock.sendall(struct.pack("<IQ", len(data), len(payload)) + data + payload)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if not n:
            raise ConnectionError("the peer closed the connection")
        got += n
    return bytes(buf)


def recv_message(sock: socket.socket) -> tuple[dict, bytes]:
    header_len, payload_len = struct.unpack("<IQ", _recv_exact(sock, 12))
    header = json.loads(_recv_exact(sock, header_len))
    return header, _recv_exact(sock, payload_len) if payload_len else b""


def parse_address(value: object, what: str) -> tuple[str, int]:
    if isinstance(value, str) and value.count(":") == 1:
        host, port = value.split(":")
        if host and port.isdigit() and 0 < int(port) < 65536:
            return host, int(port)
    raise ValueError(f'P2pConnector: {what} must be "host:port" (e.g. "10.0.0.1:14579"), got {value!r}')


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


def serve(host: str, port: int, answer) -> _Server:
    """A TCP server in a daemon thread calling ``answer(header, payload) -> (header, payload)`` per message."""

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            while True:
                try:
                    header, payload = recv_message(self.request)
                except (ConnectionError, OSError, ValueError):
                    return
                try:
                    reply = answer(header, payload)
                except Exception as exc:  # (a bad request: the peer learns why; the server lives on)
                    reply = ({"error": f"{type(exc).__name__}: {exc}"}, b"")
                send_message(self.request, *reply)

    server = _Server((host, port), Handler)
    threading.Thread(target=server.serve_forever, name=f"p2p-kv-{port}", daemon=True).start()
    return server


class _Peer:
    """One persistent connection, reopened after an error."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address
        self.sock: socket.socket | None = None

    def ask(self, header: dict, timeout: float = TIMEOUT_S) -> tuple[dict, bytes]:
        try:
            if self.sock is None:
                self.sock = socket.create_connection(self.address, timeout=min(timeout, 2.0))
            self.sock.settimeout(timeout)
            send_message(self.sock, header)
            reply, payload = recv_message(self.sock)
        except BaseException:
            self.close()
            raise
        if "error" in reply:
            raise RuntimeError(f"peer {self.address[0]}:{self.address[1]}: {reply['error']}")
        return reply, payload

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class P2pConnector(OffloadingConnector):
    name = "P2pConnector"
    description = "disaggregated prefill over TCP: decode engines pull prompt K/V from a prefill engine's host pool"
    extra_config_keys = ("cpu_bytes_to_use", "num_cpu_blocks", "block_size", "peer")

    @classmethod
    def check_config(cls, transfer_config: KVTransferConfig, config: EngineConfig) -> None:
        super(OffloadingConnector, cls).check_config(transfer_config, config)  # (the keys; not the pool's rules)
        extra = transfer_config.kv_connector_extra_config
        if transfer_config.kv_role == "kv_producer":
            check_pool_config(cls.name, extra, config)
            if "peer" in extra:
                raise ValueError('P2pConnector: "peer" is for the consumer; a producer listens on kv_ip:kv_port')
        elif transfer_config.kv_role == "kv_consumer":
            parse_address(extra.get("peer"), '"peer" (the producer\'s kv_ip:kv_port)')
            if {"cpu_bytes_to_use", "num_cpu_blocks"} & set(extra):
                raise ValueError("P2pConnector: a consumer keeps no pool; give cpu_bytes_to_use/num_cpu_blocks to the "
                                 "producer")
        else:
            raise ValueError("P2pConnector: kv_role must be 'kv_producer' (the prefill engine) or 'kv_consumer' "
                             "(the decode engine), not 'kv_both'")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._server: _Server | None = None
        self._rows: dict[str, int] = {}  # (consumer scheduler) the producer's rows of the last lookup
        self._peer: _Peer | None = None
        self._down_until = 0.0
        self._workers: list[_Peer] | None = None  # (consumer worker) the producer's workers

    @property
    def producer(self) -> bool:
        return self.transfer_config.kv_role == "kv_producer"

    # -- producer ------------------------------------------------------------------------
    def register_kv_caches(self, caches: KVCacheAccess) -> None:
        if not self.producer:
            KVConnector.register_kv_caches(self, caches)
            return
        super().register_kv_caches(caches)
        self._server = serve(self.transfer_config.kv_ip, 0, self._answer_fetch)

    def worker_info(self) -> dict[str, Any]:
        if not self.producer:
            return {}
        host, port = self._server.server_address[:2]
        return {**super().worker_info(), "address": f"{host}:{port}"}

    def on_workers_ready(self, infos: list[dict[str, Any]]) -> None:
        if not self.producer:
            return
        super().on_workers_ready(infos)
        self._worker_addresses = [info["address"] for info in infos]
        config = self.transfer_config
        try:
            self._server = serve(config.kv_ip, config.kv_port, self._answer_lookup)
        except OSError as exc:
            raise ValueError(f"P2pConnector: cannot listen on {config.kv_ip}:{config.kv_port} ({exc}); pick a free "
                             "kv_port") from None
        logger.info("P2pConnector: serving K/V lookups on %s:%d", config.kv_ip, config.kv_port)

    def _answer_lookup(self, header: dict, _: bytes) -> tuple[dict, bytes]:
        if header.get("op") == "workers":
            return {"workers": self._worker_addresses, "rank_tags": list(self.context.rank_tags)}, b""
        rows = [self._index.get(key, -1) for key in header["keys"]]  # (dict reads: safe beside the engine thread)
        return {"rows": rows, "rank_tags": list(self.context.rank_tags)}, b""

    def _answer_fetch(self, header: dict, _: bytes) -> tuple[dict, bytes]:
        ok, blocks = [], []
        for row, key in zip(header["rows"], header["keys"]):
            good = 0 <= row < len(self._row_keys) and self._row_keys[row] == key
            if good:
                block = self.pool[row].clone()
                good = self._row_keys[row] == key  # (not rewritten while copied: save_blocks clears it first)
            ok.append(good)
            if good:
                blocks.append(block)
        import torch

        payload = torch.stack(blocks).view(torch.uint8).numpy().tobytes() if blocks else b""
        return {"ok": ok, "shape": list(self.caches.block_shape), "dtype": str(self.caches.dtype)}, payload

    # -- consumer ------------------------------------------------------------------------
    def count_present(self, keys: list[str]) -> int:
        now = time.monotonic()
        if now < self._down_until:
            return 0
        if self._peer is None:
            self._peer = _Peer(parse_address(self.extra["peer"], "peer"))
        self._rows = {}  # (the scheduler looks up, allocates and takes the rows one request at a time)
        try:
            reply, _ = self._peer.ask({"op": "lookup", "keys": keys}, timeout=5.0)
        except (OSError, ConnectionError, RuntimeError, ValueError) as exc:
            self._down_until = now + RETRY_S
            logger.warning("P2pConnector: producer %s did not answer a lookup (%s); computing prompts locally for "
                           "%.0fs", self.extra["peer"], exc, RETRY_S)
            return 0
        if reply["rank_tags"] != list(self.context.rank_tags):
            self._down_until = now + RETRY_S
            logger.warning("P2pConnector: producer %s runs ranks %s, this engine %s: its K/V does not fit",
                           self.extra["peer"], reply["rank_tags"], list(self.context.rank_tags))
            return 0
        count = 0
        while count < len(keys) and reply["rows"][count] >= 0:
            self._rows[keys[count]] = reply["rows"][count]
            count += 1
        return count

    def slots_for_loads(self, keys: list[str]) -> list[int | None]:
        return [self._rows.pop(key) for key in keys]

    def on_failed_blocks(self, block_ids: set[int]) -> None:
        """(a reused row or a lost producer is passing: the keys stay worth asking for)"""

    def load_blocks(self, transfers: list[BlockTransfer]) -> set[int]:
        import torch

        failed = {t.block_id for t in transfers}
        try:
            if self._workers is None:
                lookup = _Peer(parse_address(self.extra["peer"], "peer"))
                try:
                    reply, _ = lookup.ask({"op": "workers"})
                finally:
                    lookup.close()
                self._workers = [_Peer(parse_address(a, "worker")) for a in reply["workers"]]
            reply, payload = self._workers[self.context.rank].ask(
                {"op": "fetch", "rows": [t.slot for t in transfers], "keys": [t.key for t in transfers]})
            shape, dtype = tuple(reply["shape"]), reply["dtype"]
            if shape != self.caches.block_shape or dtype != str(self.caches.dtype):
                raise ValueError(f"the producer's blocks are {dtype} {shape}, this engine's {self.caches.dtype} "
                                 f"{self.caches.block_shape}")
        except (OSError, ConnectionError, RuntimeError, ValueError) as exc:
            self._workers = None
            logger.warning("P2pConnector: cannot fetch %d KV blocks from %s: %s", len(transfers), self.extra["peer"],
                           exc)
            return failed
        good = [t.block_id for t, ok in zip(transfers, reply["ok"]) if ok]
        if good:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.caches.dtype)
            self.caches.write(good, data.view(len(good), *self.caches.block_shape))
        return failed - set(good)

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for peer in [self._peer, *(self._workers or [])]:
            if peer is not None:
                peer.close()

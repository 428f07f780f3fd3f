"""A lean HTTP/1.1 client for ``halserve bench serve``: POST a JSON body, read the response line by line.

The load generator shares the machine with the server it measures (on a 2-core CPU, the same two cores), so its
own CPU time is taken from the server and its event-loop delays are added to every TTFT it reports. httpx
(httpcore, h11 and anyio under it) spent ~120 us of client CPU per streamed token against W2 at 64 streams,
~40% of a core; this client reads asyncio streams directly (BENCHMARKS.md, "A lean benchmark client").
It speaks just what an OpenAI-compatible server's streaming endpoints need: keep-alive connections, request
bodies with Content-Length, response bodies chunked, of a Content-Length, or ending with the connection;
``http`` and ``https`` URLs. It connects to the base URL's host directly (no ``HTTP(S)_PROXY``, unlike httpx).
"""
from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

__all__ = ["HttpError", "StreamingClient"]

_MAX_HEADER_BYTES = 64 * 1024  # the streams' limit: what readuntil may buffer for a head or a chunk-size line


class HttpError(Exception):
    """The server's answer could not be read as HTTP/1.1 (or the connection broke mid-answer)."""


class _Connection:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        self.writer.close()


class Response:
    """A response whose body is read with ``lines()`` or ``read()``, once."""

    def __init__(self, conn: _Connection, status: int, headers: dict[str, str], client: StreamingClient) -> None:
        self.status_code = status
        self.headers = headers
        self._conn = conn
        self._client = client
        self._done = False
        te = headers.get("transfer-encoding", "").lower()
        self._chunked = "chunked" in te
        length = headers.get("content-length")
        self._left = int(length) if length is not None and not self._chunked else None
        self._reusable = headers.get("connection", "").lower() != "close" and (self._chunked or self._left is not None)

    async def _pieces(self) -> AsyncIterator[bytes]:
        reader = self._conn.reader
        try:
            if self._chunked:
                while True:
                    size_line = await reader.readuntil(b"\r\n")
                    size = int(size_line.split(b";", 1)[0], 16)
                    if size == 0:
                        while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers, then the blank line
                            pass
                        break
                    data = await reader.readexactly(size + 2)
                    yield data[:-2]
            elif self._left is not None:
                while self._left > 0:
                    data = await reader.read(min(self._left, 1 << 16))
                    if not data:
                        raise HttpError(f"the connection closed with {self._left} body bytes still to come")
                    self._left -= len(data)
                    yield data
            else:
                while data := await reader.read(1 << 16):
                    yield data
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            self._reusable = False
            raise HttpError(f"malformed or cut response body: {exc}") from exc
        self._done = True

    async def lines(self) -> AsyncIterator[bytes]:
        """The body's lines without their line ends (``\\n`` or ``\\r\\n``), as they arrive."""
        pending = b""
        async for piece in self._pieces():
            pending += piece
            if b"\n" not in piece:
                continue
            *complete, pending = pending.split(b"\n")
            for line in complete:
                yield line.rstrip(b"\r")
        if pending:
            yield pending.rstrip(b"\r")

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self._pieces()])

    def release(self) -> None:
        """Give the connection back for the next request (if its body was read whole), else close it."""
        if self._done and self._reusable:
            self._client._idle.append(self._conn)
        else:
            self._conn.close()


class StreamingClient:
    """``async with client.post(path, body, headers) as response``: one request on a pooled keep-alive
    connection (a new connection when none is idle; no limit: the caller bounds the concurrency)."""

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the base URL must be http://HOST[:PORT] or https://HOST[:PORT], not {base_url!r}")
        self._host = parts.hostname
        self._tls = ssl.create_default_context() if parts.scheme == "https" else None
        default_port = 443 if self._tls else 80
        self._port = parts.port or default_port
        self._prefix = parts.path.rstrip("/")
        self._host_header = self._host if self._port == default_port else f"{self._host}:{self._port}"
        self._idle: list[_Connection] = []

    async def _connect(self) -> _Connection:
        reader, writer = await asyncio.open_connection(self._host, self._port, ssl=self._tls,
                                                       limit=_MAX_HEADER_BYTES)
        return _Connection(reader, writer)

    @contextlib.asynccontextmanager
    async def post(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> AsyncIterator[Response]:
        response = await self._send(path, body, headers or {})
        try:
            yield response
        finally:
            response.release()

    async def _send(self, path: str, body: bytes, headers: dict[str, str]) -> Response:
        head = [f"POST {self._prefix}{path} HTTP/1.1", f"Host: {self._host_header}",
                "Content-Type: application/json", f"Content-Length: {len(body)}", "Accept: text/event-stream, */*"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        # an idle connection may have been closed by the server since (its keep-alive timeout): those it has
        # closed already are dropped here; one it closes while this request goes out is retried on a fresh one
        conn = self._idle_connection()
        if conn is not None:
            try:
                return await self._exchange(conn, request)
            except HttpError:
                pass
        return await self._exchange(await self._connect(), request)

    async def _exchange(self, conn: _Connection, request: bytes) -> Response:
        """Send the request on conn and read the answer's head; on any failure conn is closed (HttpError)."""
        try:
            conn.writer.write(request)
            await conn.writer.drain()
            return await self._read_head(conn)
        except ConnectionError as exc:
            conn.close()
            raise HttpError(f"{type(exc).__name__}: {exc}") from exc
        except HttpError:
            conn.close()
            raise

    def _idle_connection(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.reader.at_eof() and not conn.writer.is_closing():
                return conn
            conn.close()
        return None

    async def _read_head(self, conn: _Connection) -> Response:
        try:
            raw = await conn.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            raise HttpError("the server closed the connection without an answer"
                            + (f" (after {len(exc.partial)} bytes of its head)" if exc.partial else "")) from exc
        except asyncio.LimitOverrunError as exc:
            raise HttpError(f"response headers over {_MAX_HEADER_BYTES} bytes") from exc
        status_line, *header_lines = raw.decode("latin-1").split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise HttpError(f"not an HTTP/1.x status line: {status_line[:100]!r}")
        headers: dict[str, str] = {}
        for line in header_lines:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        return Response(conn, int(parts[1]), headers, self)

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()

    async def __aenter__(self) -> StreamingClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


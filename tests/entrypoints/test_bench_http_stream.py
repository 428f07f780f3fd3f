"""halserve.bench.http_stream: the benchmark client's HTTP/1.1 reader against hand-written server answers."""
from __future__ import annotations

import asyncio

import pytest

from halserve.bench.http_stream import HttpError, StreamingClient


async def _serve(answers: list[bytes | None], seen: list[bytes], close_after: set[int] = frozenset()):
    """A server that answers request i with answers[i] (bytes as sent), closing the connection after those in
    close_after; seen gets each request's head and body."""
    count = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal count
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                body = await reader.readexactly(length)
                seen.append(head + body)
                i = count
                count += 1
                answer = answers[i]
                if answer is None:  # read the request, then hang up without an answer
                    break
                # send in small pieces so that lines and chunks straddle reads
                for k in range(0, len(answer), 7):
                    writer.write(answer[k:k + 7])
                    await writer.drain()
                if i in close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


SSE = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\ndata: [DONE]', b"\n\n"]


def test_chunked_stream_lines_and_connection_reuse():
    async def main():
        answer = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" + _chunked(*SSE)
        seen: list[bytes] = []
        server, port = await _serve([answer, answer], seen)
        connects = 0
        async with StreamingClient(f"http://127.0.0.1:{port}/base") as client:
            original = client._connect

            async def counting():
                nonlocal connects
                connects += 1
                return await original()

            client._connect = counting
            for _ in range(2):
                async with client.post("/v1/completions", b'{"x": 1}', {"Authorization": "Bearer k"}) as r:
                    assert r.status_code == 200
                    lines = [line async for line in r.lines()]
                assert lines == [b'data: {"choices": [{"text": "a"}]}', b"", b'data: {"choices": [{"text": "b"}]}',
                                 b"", b"data: [DONE]", b""]
        server.close()
        assert connects == 1  # the second request reused the first's connection
        assert seen[0].startswith(b"POST /base/v1/completions HTTP/1.1\r\n")
        assert b"Authorization: Bearer k\r\n" in seen[0] and seen[0].endswith(b'\r\n\r\n{"x": 1}')

    asyncio.run(main())


def test_content_length_and_close_delimited_bodies_and_error_status():
    async def main():
        body = b'{"error": {"message": "bad model"}}'
        answers = [
            b"HTTP/1.1 404 Not Found\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body),
            b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nline one\r\nline two",
        ]
        seen: list[bytes] = []
        server, port = await _serve(answers, seen, close_after={1})
        async with StreamingClient(f"http://127.0.0.1:{port}") as client:
            async with client.post("/x", b"{}") as r:
                assert r.status_code == 404
                assert await r.read() == body
            async with client.post("/x", b"{}") as r:
                assert [line async for line in r.lines()] == [b"line one", b"line two"]
        server.close()

    asyncio.run(main())


def test_a_stale_idle_connection_is_retried_on_a_fresh_one():
    async def main():
        ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
        seen: list[bytes] = []
        # the server closes after answering (without saying so): the pooled connection is dead when reused
        server, port = await _serve([ok, ok], seen, close_after={0, 1})
        async with StreamingClient(f"http://127.0.0.1:{port}") as client:
            for _ in range(2):
                async with client.post("/x", b"{}") as r:
                    assert await r.read() == b"ok"
                await asyncio.sleep(0.05)
        server.close()
        assert len(seen) == 2

    asyncio.run(main())


def test_a_request_the_server_hangs_up_on_is_sent_again_once_on_a_fresh_connection():
    async def main():
        ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
        seen: list[bytes] = []
        # request 1 arrives on the kept connection, which the server then closes unanswered (its keep-alive
        # timeout racing the request); request 2 is the same request again on a new connection
        server, port = await _serve([ok, None, ok, None, None], seen)
        async with StreamingClient(f"http://127.0.0.1:{port}") as client:
            for _ in range(2):
                async with client.post("/x", b"{}") as r:
                    assert await r.read() == b"ok"
            # hung up on again on the retry's fresh connection: an error, not a third try
            with pytest.raises(HttpError, match="closed the connection without an answer"):
                async with client.post("/x", b"{}"):
                    pass
        server.close()
        assert len(seen) == 5

    asyncio.run(main())


def test_broken_answers_raise_http_errors():
    async def main():
        answers = [
            b"SMTP ready\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\nconnection: close\r\n\r\nshort",
        ]
        seen: list[bytes] = []
        server, port = await _serve(answers, seen, close_after={0, 1, 2})
        async with StreamingClient(f"http://127.0.0.1:{port}") as client:
            with pytest.raises(HttpError, match="not an HTTP/1.x status line"):
                async with client.post("/x", b"{}"):
                    pass
            with pytest.raises(HttpError, match="malformed or cut response body"):
                async with client.post("/x", b"{}") as r:
                    await r.read()
            with pytest.raises(HttpError, match="5 body bytes still to come"):
                async with client.post("/x", b"{}") as r:
                    await r.read()
        server.close()

    asyncio.run(main())


def test_bad_base_urls_are_refused():
    for url in ("ftp://host", "127.0.0.1:8000", "http://"):
        with pytest.raises(ValueError, match="base URL must be"):
            StreamingClient(url)

"""Disaggregated prefill behind one OpenAI endpoint (``halserve proxy``).

Each completion or chat request goes first to a prefill server, as the same request cut to one
token (``max_tokens`` 1, not streamed): that server computes the prompt's K/V and its KV connector
saves it (``kv_role`` ``kv_producer``). Then the whole request goes to a decode server, whose
connector loads the prompt's K/V instead of computing it (``kv_consumer``) and which generates the
reply; the client gets the decode server's answer, streamed or not, as is::

    client --> proxy --(max_tokens=1)--> prefill server --saves K/V--> shared storage
                     \\--(the request)---> decode server  <--loads K/V--/

Servers are picked round-robin. An error of either server reaches the client unchanged (its
status and OpenAI error body); an unreachable one is a 502 that names it.
"""
from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")


def _error(status: int, message: str, kind: str) -> Any:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}},
                        status_code=status)


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill server gets: the same prompt and settings, one token, not streamed."""
    body = dict(body, max_tokens=1, stream=False, n=1)
    body.pop("stream_options", None)
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    return body


def build_proxy_app(prefill_urls: Sequence[str], decode_urls: Sequence[str], timeout: float = 600.0) -> FastAPI:
    # (the routes' annotations name module-level classes: FastAPI resolves them from this module)
    if not prefill_urls or not decode_urls:
        raise ValueError("the proxy needs at least one --prefill and one --decode server URL")
    prefills, decodes = itertools.cycle(prefill_urls), itertools.cycle(decode_urls)
    client = httpx.AsyncClient(timeout=timeout)
    app = FastAPI(title="halserve disaggregated-prefill proxy", on_shutdown=[client.aclose])

    def forward_headers(request: Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "x-request-id")}

    async def generate(request: Request) -> Any:
        path = request.url.path
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return _error(400, f"the request body is not JSON: {exc}", "BadRequestError")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "BadRequestError")
        headers = forward_headers(request)
        prefill, decode = next(prefills), next(decodes)
        try:
            reply = await client.post(prefill + path, json=prefill_request(body), headers=headers)
        except httpx.HTTPError as exc:
            return _error(502, f"prefill server {prefill} unreachable: {exc!r}", "BadGatewayError")
        if reply.status_code != 200:  # (a bad request: the client sees the server's own error)
            return Response(reply.content, status_code=reply.status_code, media_type="application/json")
        try:
            answer = await client.send(client.build_request("POST", decode + path, json=body, headers=headers),
                                       stream=True)
        except httpx.HTTPError as exc:
            return _error(502, f"decode server {decode} unreachable: {exc!r}", "BadGatewayError")
        if answer.status_code != 200 or not body.get("stream"):
            content = await answer.aread()
            await answer.aclose()
            return Response(content, status_code=answer.status_code,
                            media_type=answer.headers.get("content-type", "application/json"))
        return StreamingResponse(answer.aiter_raw(), media_type="text/event-stream",
                                 background=BackgroundTask(answer.aclose))

    for path in GENERATE_PATHS:
        app.add_api_route(path, generate, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        decode = next(decodes)
        try:
            reply = await client.get(decode + "/v1/models", headers=forward_headers(request))
        except httpx.HTTPError as exc:
            return _error(502, f"decode server {decode} unreachable: {exc!r}", "BadGatewayError")
        return Response(reply.content, status_code=reply.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Any:
        down = []
        for url in (*prefill_urls, *decode_urls):
            try:
                if (await client.get(url + "/health")).status_code != 200:
                    down.append(url)
            except httpx.HTTPError:
                down.append(url)
        if down:
            return JSONResponse({"status": "unhealthy", "down": down}, status_code=503)
        return JSONResponse({"status": "ok"})

    return app

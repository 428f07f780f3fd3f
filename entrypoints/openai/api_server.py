"""The OpenAI-compatible HTTP server: the FastAPI app and running it under uvicorn.

Routes: POST /v1/completions, /v1/chat/completions, /v1/responses, /v1/embeddings, /classify, /score (and
/v1/score), /rerank (and /v1/rerank, /v2/rerank), /tokenize, /detokenize, /v1/load_lora_adapter,
/v1/unload_lora_adapter, Anthropic's /v1/messages and /v1/messages/count_tokens (``halserve.entrypoints.anthropic``);
GET /v1/models, /v1/models/{model}, /health (and HEAD), /version, /metrics; with --enable-sleep-mode, POST /sleep,
/wake_up, /reset_prefix_cache, /update_weights, /collective_rpc and GET /is_sleeping (serving_sleep.py).
Request bodies are parsed here (not by FastAPI) so malformed JSON and wrong types are OpenAI-shaped
400s, and a body over ``max_body_bytes`` is a 413 before it is all read. Large bodies are parsed
(and large /detokenize calls served) in a worker process (offload.py), so no single request
stalls the event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import signal
import threading
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from halserve import __version__
from halserve.engine.request_stream import EngineStoppedError
from halserve.entrypoints.anthropic import (
    AnthropicServingMessages,
    CountTokensRequest,
    MessagesRequest,
    anthropic_error_response,
    anthropic_route,
)
from halserve.entrypoints.openai.chat_protocol import ChatCompletionRequest
from halserve.entrypoints.openai.errors import (
    NotFoundError,
    OpenAIError,
    error_body,
    error_response,
    install_error_handlers,
    parse_body,
)
from halserve.entrypoints.openai.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from halserve.entrypoints.openai.offload import RequestOffloader, release_request_in_thread
from halserve.entrypoints.openai.protocol import CompletionRequest
from halserve.entrypoints.openai.responses_protocol import ResponsesRequest
from halserve.entrypoints.openai.score_protocol import RerankRequest, ScoreRequest
from halserve.entrypoints.openai.serving_chat import OpenAIServingChat
from halserve.entrypoints.openai.serving_classification import ClassificationRequest, OpenAIServingClassification
from halserve.entrypoints.openai.serving_completions import OpenAIServingCompletion
from halserve.entrypoints.openai.serving_embeddings import EmbeddingRequest, OpenAIServingEmbedding
from halserve.entrypoints.openai.serving_engine import OpenAIServing
from halserve.entrypoints.openai.serving_lora import LoadLoRAAdapterRequest, OpenAIServingLoRA, UnloadLoRAAdapterRequest
from halserve.entrypoints.openai.serving_responses import OpenAIServingResponses
from halserve.entrypoints.openai.serving_score import OpenAIServingScore
from halserve.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from halserve.entrypoints.openai.tokenize_protocol import DetokenizeRequest, TokenizeRequest
from halserve.tracing import TraceContextMiddleware

if TYPE_CHECKING:  # pragma: no cover
    import socket

    from halserve.config import EngineConfig
    from halserve.engine.async_llm import AsyncLLM

logger = logging.getLogger("halserve.server")

__all__ = ["build_app", "run_server"]

# Paths anyone may reach even when --api-key is set (probes and scrapers).
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
DEFAULT_MAX_BODY_BYTES = 32 * 2**20


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 as soon as it is known to exceed ``limit`` bytes."""
    too_large = OpenAIError(
        f"the request body is larger than this server's limit of {limit} bytes "
        "(halserve serve --max-request-body-size)", code="request_too_large", status_code=413,
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def guarded(route: Any) -> Any:
    """An unexpected exception in ``route`` becomes a logged 500 here: left to Starlette, the
    500 is sent and then the exception re-raised, which makes uvicorn drop the keep-alive
    connection under the client's next request."""

    @functools.wraps(route)
    async def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return await route(*args, **kwargs)
        except OpenAIError:
            raise
        except ClientDisconnect:  # the client left while sending its body: nobody to answer
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - a bug: report it, keep the connection
            logger.exception("internal error while serving a request")
            return error_response(f"internal server error: {type(exc).__name__}: {exc}", 500)

    return run


class APIKeyMiddleware:
    """Pure ASGI middleware (streaming-safe): ``Authorization: Bearer <key>`` (or Anthropic's
    ``x-api-key: <key>``) must match one of the configured keys, compared in constant time."""

    def __init__(self, app: Any, api_keys: Sequence[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in api_keys]

    def _authorized(self, header: bytes | None, x_api_key: bytes | None = None) -> bool:
        if x_api_key:
            given = x_api_key.strip()
        elif header and header.lower().startswith(b"bearer "):
            given = header[7:].strip()
        else:
            return False
        ok = False
        for key in self.keys:  # check every key: timing does not reveal which matched
            ok |= hmac.compare_digest(given, key)
        return ok

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self._authorized(headers.get(b"authorization"), headers.get(b"x-api-key")):
            await self.app(scope, receive, send)
            return
        if scope["path"].startswith("/v1/messages"):  # (Anthropic's clients read Anthropic's error shape)
            anthropic = anthropic_error_response("invalid x-api-key: send the key as 'x-api-key: <key>' or "
                                                 "'Authorization: Bearer <key>'", 401)
            await anthropic(scope, receive, send)
            return
        response = error_response(
            "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'",
            401,
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)


def build_app(serving: OpenAIServing, metrics: ServerMetrics, api_keys: Sequence[str] | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, enable_sleep_mode: bool = False) -> FastAPI:
    engine = serving.engine
    offloader = RequestOffloader(serving.tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        offloader.start()
        try:
            yield
        finally:
            await asyncio.gather(engine.shutdown(), asyncio.to_thread(offloader.shutdown))

    app = FastAPI(title="halserve OpenAI-compatible API", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    completion = OpenAIServingCompletion(serving)
    chat = OpenAIServingChat(serving)
    responses = OpenAIServingResponses(serving, chat)
    tokenization = OpenAIServingTokenization(serving)
    embedding = OpenAIServingEmbedding(serving)
    classification = OpenAIServingClassification(serving)
    scoring = OpenAIServingScore(serving)
    lora = OpenAIServingLoRA(serving)
    messages = AnthropicServingMessages(chat)

    async def body(model: type, raw_request: Request) -> Any:
        return await offloader.parse(model, await read_body(raw_request, max_body_bytes))

    @app.post("/v1/completions")
    @guarded
    async def create_completion(raw_request: Request) -> Response:
        req = await body(CompletionRequest, raw_request)
        try:
            response = await completion.create(req, raw_request)
        except BaseException:
            release_request_in_thread(req)  # (a big batch's prompts: freed off the event loop)
            raise
        if not isinstance(response, StreamingResponse):
            release_request_in_thread(req)
        return response

    @app.post("/v1/chat/completions")
    @guarded
    async def create_chat_completion(raw_request: Request) -> Response:
        return await chat.create(await body(ChatCompletionRequest, raw_request), raw_request)

    @app.post("/v1/messages")
    @anthropic_route
    async def create_message(raw_request: Request) -> Response:
        return await messages.create(await body(MessagesRequest, raw_request), raw_request)

    @app.post("/v1/messages/count_tokens")
    @anthropic_route
    async def count_message_tokens(raw_request: Request) -> JSONResponse:
        return JSONResponse((await messages.count_tokens(await body(CountTokensRequest, raw_request))).model_dump())

    @app.post("/v1/responses")
    @guarded
    async def create_response(raw_request: Request) -> Response:
        return await responses.create(await body(ResponsesRequest, raw_request), raw_request)

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(response_id: str) -> JSONResponse:
        raise NotFoundError(f"Response with id {response_id!r} not found: this server does not store responses",
                            param="response_id")

    @app.post("/v1/embeddings")
    @guarded
    async def create_embedding(raw_request: Request) -> Response:
        return await embedding.create(await body(EmbeddingRequest, raw_request), raw_request)

    @app.post("/classify")
    @guarded
    async def create_classify(raw_request: Request) -> Response:
        return await classification.create(await body(ClassificationRequest, raw_request), raw_request)

    @app.post("/score")
    @app.post("/v1/score")
    @guarded
    async def create_score(raw_request: Request) -> Response:
        return await scoring.score(await body(ScoreRequest, raw_request), raw_request)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    @guarded
    async def do_rerank(raw_request: Request) -> Response:
        return await scoring.rerank(await body(RerankRequest, raw_request), raw_request)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def show_models() -> JSONResponse:
        return JSONResponse(tokenization.models().model_dump())

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def show_model(model_id: str) -> JSONResponse:
        name = serving.check_model(model_id or None)  # (an unknown name is a 404)
        (card,) = [card for card in tokenization.models().data if card.id == name]
        return JSONResponse(card.model_dump())

    @app.post("/v1/load_lora_adapter")
    @guarded
    async def load_lora_adapter(raw_request: Request) -> Response:
        lora.check_enabled()
        return await lora.load(await body(LoadLoRAAdapterRequest, raw_request))

    @app.post("/v1/unload_lora_adapter")
    @guarded
    async def unload_lora_adapter(raw_request: Request) -> Response:
        lora.check_enabled()
        return await lora.unload(await body(UnloadLoRAAdapterRequest, raw_request))

    @app.post("/tokenize")
    @guarded
    async def tokenize(raw_request: Request) -> JSONResponse:
        req = await body(TokenizeRequest, raw_request)
        return JSONResponse((await tokenization.tokenize(req)).model_dump())

    @app.post("/detokenize")
    @guarded
    async def detokenize(raw_request: Request) -> Response:
        raw = await read_body(raw_request, max_body_bytes)
        done = await offloader.detokenize(raw, serving.vocab_size)
        if done is not None:  # (a large one: parsed, checked and decoded in the worker)
            model, response_body = done
            serving.check_model(model)
            return Response(response_body, media_type="application/json")
        req = parse_body(DetokenizeRequest, raw)
        return JSONResponse((await tokenization.detokenize(req)).model_dump())

    if enable_sleep_mode:  # (vLLM's dev endpoints: absent, hence 404, without the flag)
        from halserve.entrypoints.openai.serving_sleep import add_sleep_routes

        add_sleep_routes(app, engine, max_body_bytes)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if engine.dead_error is not None:
            return JSONResponse(error_body(f"the engine died: {engine.dead_error!r}", 503, code="engine_dead"), 503)
        if not engine.is_healthy:
            return JSONResponse(error_body("the server is shutting down", 503, code="shutting_down"), 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def show_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(TraceContextMiddleware)  # (W3C traceparent -> the requests' spans: halserve.tracing)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=list(api_keys))
    return app


# After the engine died: how long /health answers 503 (and failed streams flush) before the server exits 1.
ENGINE_DEATH_EXIT_DELAY_S = 1.0
# After the engine core stopped on SIGTERM: how long the server waits for its own signal (a signal to
# the process group reaches both at once) before it takes the stop for the engine's death.
ENGINE_STOP_GRACE_S = 0.5


def _make_server(config: EngineConfig, engine: AsyncLLM, url: str, served: str) -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn, plus: a signal first ends every in-flight request (finish_reason
        "abort") so connections drain at once, and the process exits 0 afterwards
        (uvicorn re-raises the signal by default, which would kill it). If the engine
        dies, every stream fails, /health turns 503 and the server exits (``engine_died``)."""

        engine_died = False

        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: Any) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first:
                logger.info("received %s: aborting in-flight requests and shutting down", signal.Signals(sig).name)
                engine.request_shutdown()

        async def startup(self, sockets: Any = None) -> None:
            engine.death_callbacks.append(self._on_engine_death)
            await super().startup(sockets=sockets)
            if not self.should_exit:
                logger.info("halserve is serving %s at %s", served, url)

        def _on_engine_death(self, exc: BaseException) -> None:
            if isinstance(exc, EngineStoppedError):
                # The engine core stopped on SIGTERM. With a signal to the whole process group
                # (systemd, `kill -- -PGID`) this server has one too, or is about to: an orderly
                # stop, exit 0. A SIGTERM to the engine core alone is its death.
                asyncio.get_running_loop().call_later(ENGINE_STOP_GRACE_S, self._after_engine_stop, exc)
                return
            self._engine_death(exc)

        def _after_engine_stop(self, exc: BaseException) -> None:
            if self.should_exit:
                logger.info("the engine core stopped with the server (%s)", exc)
            else:
                self._engine_death(exc)

        def _engine_death(self, exc: BaseException) -> None:
            self.engine_died = True
            logger.error("the engine died (%s): exiting in %.0fs", exc, ENGINE_DEATH_EXIT_DELAY_S)
            asyncio.get_running_loop().call_later(ENGINE_DEATH_EXIT_DELAY_S, setattr, self, "should_exit", True)

    return Server(config)


def run_server(
    serving: OpenAIServing,
    metrics: ServerMetrics,
    host: str,
    port: int,
    api_keys: Sequence[str] | None = None,
    log_level: str = "info",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    sock: socket.socket | None = None,
    enable_sleep_mode: bool = False,
) -> int:
    """Serve until SIGINT/SIGTERM (exit code 0) or the engine's death (1); returns the exit
    code. ``sock``: an already bound listening socket to serve on (``--api-server-count``)."""
    import uvicorn

    app = build_app(serving, metrics, api_keys, max_body_bytes, enable_sleep_mode)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level.lower(),
        access_log=log_level.lower() == "debug",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
    )
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    server = _make_server(config, serving.engine, f"http://{shown_host}:{port}", ", ".join(serving.served_model_names))
    server.run(sockets=[sock] if sock is not None else None)
    return 0 if server.started and not server.engine_died else 1

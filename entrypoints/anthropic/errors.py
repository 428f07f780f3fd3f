"""Anthropic-shaped errors: ``{"type": "error", "error": {"type": ..., "message": ...}}``.

The Messages routes raise the server's ``OpenAIError``s like every other route; ``anthropic_route``
turns them into this shape with the same status code (400 invalid_request_error, 401
authentication_error, 404 not_found_error, 413 request_too_large, 5xx api_error)."""
from __future__ import annotations

import functools
import json
import logging
from typing import Any

from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from halserve.engine.async_llm import EngineDeadError
from halserve.entrypoints.openai.errors import OpenAIError

logger = logging.getLogger("halserve.server")

__all__ = ["anthropic_error_body", "anthropic_error_event", "anthropic_error_response", "anthropic_route"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def anthropic_error_body(message: str, status_code: int) -> dict[str, Any]:
    kind = _TYPES.get(status_code, "invalid_request_error" if status_code < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error_response(message: str, status_code: int, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(anthropic_error_body(message, status_code), status_code=status_code, headers=headers)


def _message(exc: OpenAIError) -> str:
    """The message, with the field it is about when the message does not start with it."""
    if exc.param and not exc.message.startswith(exc.param):
        return f"{exc.param}: {exc.message}"
    return exc.message


def anthropic_error_event(exc: BaseException) -> str:
    """The SSE ``error`` event for an error raised after the stream started."""
    if isinstance(exc, OpenAIError):
        body = anthropic_error_body(_message(exc), exc.status_code)
    elif isinstance(exc, EngineDeadError):
        body = anthropic_error_body(str(exc), 503)
    else:
        logger.exception("error while streaming", exc_info=exc)
        body = anthropic_error_body(f"internal server error: {type(exc).__name__}: {exc}", 500)
    return f"event: error\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


def anthropic_route(route: Any) -> Any:
    """Run ``route``, answering its errors in Anthropic's shape (the rest of the server answers
    OpenAI's); an unexpected exception is a logged 500 that keeps the connection."""

    @functools.wraps(route)
    async def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return await route(*args, **kwargs)
        except OpenAIError as exc:
            return anthropic_error_response(_message(exc), exc.status_code)
        except ClientDisconnect:  # the client left while sending its body: nobody to answer
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - a bug: report it, keep the connection
            logger.exception("internal error while serving a request")
            return anthropic_error_response(f"internal server error: {type(exc).__name__}: {exc}", 500)

    return run

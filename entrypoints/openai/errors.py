"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Every invalid input is a 400 with a message that says what was wrong; an unknown model
is a 404, a missing or wrong API key a 401, a dead engine a 503; 500 is kept for bugs.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

__all__ = [
    "OpenAIError",
    "BadRequestError",
    "NotFoundError",
    "error_body",
    "error_response",
    "install_error_handlers",
    "validation_message",
]

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class OpenAIError(Exception):
    """An error to report to the client as JSON (or as an SSE event mid-stream)."""

    status_code = 500

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status_code: int | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        if status_code is not None:
            self.status_code = status_code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status_code, param=self.param, code=self.code)


class BadRequestError(OpenAIError):
    status_code = 400


class NotFoundError(OpenAIError):
    status_code = 404


def error_body(message: str, status_code: int, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status_code, "invalid_request_error" if status_code < 500 else "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    message: str, status_code: int, *, param: str | None = None, code: str | None = None, headers: dict | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, status_code, param=param, code=code), status_code=status_code, headers=headers)


def _loc_to_param(loc: tuple | list) -> str | None:
    """``("body", "messages", 0, "content")`` -> ``"messages[0].content"``; union branch
    names pydantic inserts (``list[int]``, ``str``, ``function-after[...]``) are dropped."""
    parts: list[str] = []
    for item in loc:
        if item == "body" and not parts:
            continue
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(item, str) and ("[" in item or item in ("str", "int", "float", "bool", "none")):
            continue
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or None


def _field_named_by(message: str, fields: Iterable[str]) -> str | None:
    """The field a message starts with (``"n must be ..."``, ``"allowed_token_ids=[] ..."``,
    ``"top_logprobs: ..."``), if it is one of ``fields``; else None."""
    word = re.split(r"[\s=:(\[]", message, maxsplit=1)[0]
    return word if word in fields else None


def validation_message(errors: list[dict[str, Any]], hints: dict[str, str] | None = None,
                       fields: Iterable[str] = ()) -> tuple[str, str | None]:
    """One readable message (and the first offending param) for pydantic errors.
    ``hints`` maps a union-typed field to what it accepts, instead of one complaint per
    union branch. ``fields``: the model's field names; a check across fields (a model
    validator: its error has no location) names as its param the field its message starts
    with, so clients that read ``param`` learn which field to fix."""
    if not errors:
        return "invalid request", None
    lines = []
    seen: set[str] = set()
    first_param = None
    for err in errors:
        param = _loc_to_param(err.get("loc", ()))
        root = str(param or "").split("[")[0].split(".")[0]
        msg = str(err.get("msg", "invalid value"))
        if hints and root in hints and err.get("type", "").endswith("_type"):
            param, msg = root, f"must be {hints[root]}"
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        if param is None:
            first_param = first_param or _field_named_by(msg, fields)
        first_param = first_param or param
        key = f"{param}: {msg}" if param else msg
        if key in seen:
            continue
        seen.add(key)
        lines.append(key)
        if len(lines) >= 4:
            break
    return "; ".join(lines), first_param


def parse_body(model: type, raw: bytes) -> Any:
    """Parse a JSON body into ``model``; malformed JSON or invalid fields raise a 400."""
    if not raw.strip():
        raise BadRequestError("the request body is empty; send a JSON object")
    raw = raw.removeprefix(b"\xef\xbb\xbf")  # (a UTF-8 byte order mark: json.loads skips it, pydantic would not)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise BadRequestError("the request body nests arrays or objects too deeply to parse",
                              code="invalid_json") from None
    if not isinstance(data, dict):
        raise BadRequestError(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        # (what json.loads took but pydantic's stricter parser does not: a number past float's
        # range, a lone UTF-16 surrogate in a string escape)
        invalid = next((err for err in errors if err.get("type") == "json_invalid"), None)
        if invalid is not None:
            reason = str(invalid.get("msg", "")).removeprefix("Invalid JSON: ")
            if reason.startswith("recursion limit exceeded"):  # (pydantic parses at most 200 levels deep)
                raise BadRequestError(f"the request body nests arrays or objects too deeply to parse ({reason})",
                                      code="invalid_json") from None
            raise BadRequestError(f"the request body is not valid JSON: {reason}", code="invalid_json") from None
        message, param = validation_message(errors, getattr(model, "type_hints", None), model.model_fields)
        raise BadRequestError(message, param=param) from None


def install_error_handlers(app: FastAPI) -> None:
    """Make every error OpenAI-shaped: validation -> 400, HTTP errors keep their code,
    anything unexpected -> 500 (logged)."""

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return error_response(message, 400, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving a request")
        return error_response(f"internal server error: {type(exc).__name__}: {exc}", 500)

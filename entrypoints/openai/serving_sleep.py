"""vLLM's sleep-mode endpoints, present only with ``--enable-sleep-mode`` (404 without, as vLLM's dev
endpoints), for RL loops that put the engine to sleep between rollouts and load new weights:

    POST /sleep?level=1|2      level 1 drops the KV cache (weights kept in host memory), level 2 drops
                               the weights too; the memory goes back to the OS or the device (200)
    POST /wake_up              weights (level 2: reloaded) and KV cache back; requests run again (200)
    GET  /is_sleeping          {"is_sleeping": bool}
    POST /reset_prefix_cache   forget every cached prefix (200)
    POST /update_weights       {"path": CHECKPOINT_FOLDER}: serve that checkpoint's weights (same
                               architecture; asleep or with no request running); a mismatch is a 400
                               naming it, and the old weights keep serving

While asleep a completion or chat request is a 503 (code ``engine_sleeping``) that says to call
/wake_up. The engine core does the work between steps (halserve.engine.core), in its own process or not.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from halserve.engine.request_stream import EngineDeadError
from halserve.entrypoints.openai.errors import BadRequestError, OpenAIError, parse_body

if TYPE_CHECKING:  # pragma: no cover
    from fastapi import FastAPI

    from halserve.engine.async_llm import AsyncLLM


class UpdateWeightsRequest(BaseModel):
    """The body of ``POST /update_weights``."""

    model_config = ConfigDict(extra="forbid")
    path: str  # a checkpoint folder (config.json and *.safetensors) on the server's disk


def add_sleep_routes(app: FastAPI, engine: AsyncLLM, max_body_bytes: int) -> None:
    """Register the routes of the module docstring on ``app``."""

    async def call(method: str, *args: Any) -> Any:
        try:
            return await engine.call_core(method, *args)
        except ValueError as exc:  # the caller's mistake (a bad level, a mismatched checkpoint, busy)
            raise BadRequestError(str(exc)) from None
        except EngineDeadError as exc:
            raise OpenAIError(str(exc), status_code=503, code="engine_dead") from None

    @app.post("/sleep")
    async def sleep(raw_request: Request) -> Response:
        text = raw_request.query_params.get("level", "1")
        if text not in ("1", "2"):
            raise BadRequestError(f"level must be 1 (drop the KV cache) or 2 (drop the weights too), got {text!r}",
                                  param="level")
        await call("sleep", int(text))
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up() -> Response:
        await call("wake_up")
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": bool(await call("is_sleeping"))})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        if not await call("reset_prefix_cache"):
            raise OpenAIError("the prefix cache could not be reset: requests are running; try again when idle",
                              status_code=409, code="busy")
        return Response(status_code=200)

    @app.post("/update_weights")
    async def update_weights(raw_request: Request) -> Response:
        from halserve.entrypoints.openai.api_server import read_body

        req = parse_body(UpdateWeightsRequest, await read_body(raw_request, max_body_bytes))
        await call("update_weights", req.path)
        return Response(status_code=200)

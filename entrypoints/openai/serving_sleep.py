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
    POST /collective_rpc       {"method": NAME, "args": [...], "kwargs": {...}, "timeout": null}: the
                               public worker method NAME on every worker; {"results": [one per rank]}.
                               An unknown or private method is a 400 naming it, as is one the engine
                               drives itself (sleep, add_lora, ...: their routes), and a result JSON
                               cannot hold (naming its type; the call has run)

While asleep a completion or chat request is a 503 (code ``engine_sleeping``) that says to call
/wake_up. The engine core does the work between steps (halserve.engine.core), in its own process or not.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from halserve.engine.request_stream import EngineDeadError
from halserve.entrypoints.openai.errors import BadRequestError, OpenAIError, parse_body

if TYPE_CHECKING:  # pragma: no cover
    from fastapi import FastAPI

    from halserve.engine.async_llm import AsyncLLM


class UpdateWeightsRequest(BaseModel):
    """The body of ``POST /update_weights``."""

    model_config = ConfigDict(extra="forbid")
    path: str  # a checkpoint folder (config.json and *.safetensors) on the server's disk


class CollectiveRpcRequest(BaseModel):
    """The body of ``POST /collective_rpc`` (vLLM's)."""

    model_config = ConfigDict(extra="forbid")
    method: str  # a public method of halserve.worker.worker.Worker
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None  # only null: HALSERVE_MP_RPC_TIMEOUT_S bounds the mp executor's calls


# Worker methods the engine core drives itself: called behind its back they would leave its state wrong
# (asleep workers under an engine that thinks them awake, adapters its registry does not know), so the
# endpoint refuses them, naming the route that does it properly where there is one.
ENGINE_DRIVEN_METHODS = {
    "sleep": "POST /sleep", "wake_up": "POST /wake_up", "update_weights": "POST /update_weights",
    "add_lora": "POST /v1/load_lora_adapter", "remove_lora": "POST /v1/unload_lora_adapter",
    "init_device": None, "load_model": None, "initialize_kv_cache": None, "warm_up": None,
    "execute_model": None, "shutdown": None,
    # (async scheduling's halves of a step: a stray call launches a step of garbage or takes the
    # output of the engine's own step)
    "execute_model_deferred": None, "take_deferred_output": None,
}


def json_results(method: str, results: list[Any]) -> list[Any]:
    """``results`` (one per rank) as they are, when JSON can hold them; otherwise a 400 naming the first
    value that it cannot (where it is and its type)."""
    def check(value: Any, where: str) -> None:
        if value is None or isinstance(value, (bool, int, str)):
            return
        if isinstance(value, float):
            if not math.isfinite(value):
                raise _unserializable(method, where, f"the float {value!r}")
            return
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                check(item, f"{where}[{i}]")
            return
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise _unserializable(method, f"{where} (a key)", f"a {type(key).__module__}."
                                          f"{type(key).__qualname__} key {key!r:.40}")
                check(item, f"{where}[{key!r}]")
            return
        kind = type(value)
        raise _unserializable(method, where, f"a {kind.__module__}.{kind.__qualname__}")

    for rank, result in enumerate(results):
        check(result, f"results[{rank}]")
    return results


def _unserializable(method: str, where: str, what: str) -> BadRequestError:
    return BadRequestError(f"collective_rpc: worker method {method!r} ran, but {where} is {what}, which JSON "
                           "cannot hold; call a method that returns JSON values (null, booleans, numbers, "
                           "strings, lists, objects with string keys)", code="unserializable_result")


def add_sleep_routes(app: FastAPI, engine: AsyncLLM, max_body_bytes: int) -> None:
    """Register the routes of the module docstring on ``app`` (each ``guarded``: an unexpected
    error is a 500 that keeps the client's connection)."""
    from halserve.entrypoints.openai.api_server import guarded

    async def call(method: str, *args: Any) -> Any:
        try:
            return await engine.call_core(method, *args)
        except ValueError as exc:  # the caller's mistake (a bad level, a mismatched checkpoint, busy)
            raise BadRequestError(str(exc)) from None
        except EngineDeadError as exc:
            raise OpenAIError(str(exc), status_code=503, code="engine_dead") from None

    @app.post("/sleep")
    @guarded
    async def sleep(raw_request: Request) -> Response:
        text = raw_request.query_params.get("level", "1")
        if text not in ("1", "2"):
            raise BadRequestError(f"level must be 1 (drop the KV cache) or 2 (drop the weights too), got {text!r}",
                                  param="level")
        await call("sleep", int(text))
        return Response(status_code=200)

    @app.post("/wake_up")
    @guarded
    async def wake_up() -> Response:
        await call("wake_up")
        return Response(status_code=200)

    @app.get("/is_sleeping")
    @guarded
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": bool(await call("is_sleeping"))})

    @app.post("/reset_prefix_cache")
    @guarded
    async def reset_prefix_cache() -> Response:
        if not await call("reset_prefix_cache"):
            raise OpenAIError("the prefix cache could not be reset: requests are running; try again when idle",
                              status_code=409, code="busy")
        return Response(status_code=200)

    @app.post("/update_weights")
    @guarded
    async def update_weights(raw_request: Request) -> Response:
        from halserve.entrypoints.openai.api_server import read_body

        req = parse_body(UpdateWeightsRequest, await read_body(raw_request, max_body_bytes))
        await call("update_weights", req.path)
        return Response(status_code=200)

    @app.post("/collective_rpc")
    @guarded
    async def collective_rpc(raw_request: Request) -> JSONResponse:
        from halserve.entrypoints.openai.api_server import read_body

        req = parse_body(CollectiveRpcRequest, await read_body(raw_request, max_body_bytes))
        if req.timeout is not None:
            raise BadRequestError(f"timeout={req.timeout!r} is not supported; send null (the server's "
                                  "HALSERVE_MP_RPC_TIMEOUT_S bounds every worker call)", param="timeout")
        if req.method in ENGINE_DRIVEN_METHODS:
            route = ENGINE_DRIVEN_METHODS[req.method]
            raise BadRequestError(f"collective_rpc: {req.method!r} is driven by the engine itself; "
                                  + (f"use {route}" if route else "it cannot be called through /collective_rpc"),
                                  param="method")
        try:
            results = await call("collective_rpc", req.method, tuple(req.args), req.kwargs)
        except TypeError as exc:  # (arguments the method does not take)
            raise BadRequestError(f"collective_rpc: worker method {req.method!r} refused the arguments: {exc}; "
                                  "check args and kwargs") from None
        return JSONResponse({"results": json_results(req.method, results)})

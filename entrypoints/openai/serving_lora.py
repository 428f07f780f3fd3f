"""LoRA adapters served by name: ``--lora-modules``, ``/v1/models`` entries, and vLLM's runtime
endpoints ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``.

A request whose ``model`` is an adapter's name runs on the base model with that adapter.
The runtime endpoints exist only with ``--allow-runtime-lora-updating`` (or vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``): anyone who can reach them can make the server
read files from its disk.
"""
from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi.responses import PlainTextResponse

from halserve.entrypoints.openai.errors import BadRequestError, NotFoundError
from halserve.entrypoints.openai.protocol import OpenAIModel
from halserve.lora.request import LoRARequest

if TYPE_CHECKING:  # pragma: no cover
    from halserve.entrypoints.openai.serving_engine import OpenAIServing

RUNTIME_UPDATING_ENV_VARS = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "HALSERVE_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updating_from_env() -> bool:
    return any(os.environ.get(name, "").strip().lower() in ("1", "true") for name in RUNTIME_UPDATING_ENV_VARS)


@dataclass(frozen=True, slots=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoRAModulePath:
        """``name=path`` or vLLM's JSON ``{"name": ..., "path": ..., "base_model_name": ...}``."""
        if text.lstrip().startswith("{"):
            try:
                data = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"invalid JSON in --lora-modules {text!r}: {exc}") from None
            if not isinstance(data.get("name"), str) or not isinstance(data.get("path"), str):
                raise ValueError(f"--lora-modules {text!r}: the JSON form needs string 'name' and 'path'")
            return cls(data["name"], data["path"], data.get("base_model_name"))
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {text!r}: use name=path or '{{\"name\": ..., \"path\": ...}}'")
        return cls(name, path)


class LoRAModules:
    """The adapters a server offers, by name; each gets its own ``lora_int_id``."""

    def __init__(self, allow_runtime_updates: bool = False) -> None:
        self.allow_runtime_updates = allow_runtime_updates
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def get(self, name: str | None) -> LoRARequest | None:
        return self._by_name.get(name) if name is not None else None

    def values(self) -> list[LoRARequest]:
        return list(self._by_name.values())

    def new_request(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        return LoRARequest(name, next(self._ids), path, base_model_name=base_model_name)

    def add(self, lora: LoRARequest) -> None:
        self._by_name[lora.lora_name] = lora

    def remove(self, name: str) -> LoRARequest | None:
        return self._by_name.pop(name, None)


class LoadLoRAAdapterRequest(OpenAIModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace an adapter of that name


class UnloadLoRAAdapterRequest(OpenAIModel):
    lora_name: str
    lora_int_id: int | None = None


class OpenAIServingLoRA:
    """The runtime endpoints (vLLM's names, bodies and plain-text answers)."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def check_enabled(self) -> None:
        if not self.serving.lora_modules.allow_runtime_updates:
            raise NotFoundError("loading and unloading LoRA adapters at runtime is disabled on this server; start "
                                "it with --enable-lora --allow-runtime-lora-updating (or "
                                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)", code="runtime_lora_updating_disabled")

    async def load(self, req: LoadLoRAAdapterRequest) -> PlainTextResponse:
        modules = self.serving.lora_modules
        name = req.lora_name
        if not name or not req.lora_path:
            raise BadRequestError("both 'lora_name' and 'lora_path' must be non-empty", param="lora_name")
        if name in self.serving.served_model_names:
            raise BadRequestError(f"'{name}' is the base model's name; give the adapter another name",
                                  param="lora_name")
        previous = modules.get(name)
        if previous is not None and not req.load_inplace:
            raise BadRequestError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        lora = modules.new_request(name, req.lora_path)
        try:
            await self.serving.engine.add_lora(lora)
        except ValueError as exc:
            raise BadRequestError(str(exc), param="lora_path", code="invalid_lora_adapter") from None
        modules.add(lora)
        if previous is not None:
            await self.serving.engine.remove_lora(previous.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, req: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        lora = self.serving.lora_modules.remove(req.lora_name)
        if lora is None:
            raise NotFoundError(f"The lora adapter '{req.lora_name}' cannot be found.", param="lora_name")
        await self.serving.engine.remove_lora(lora.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


def register_static_loras(engine_core, modules: LoRAModules, paths: list[LoRAModulePath],
                          served_model_names: list[str]) -> None:
    """``--lora-modules``, loaded and validated at startup (before the engine thread runs);
    ValueError naming the bad one."""
    for entry in paths:
        if entry.name in served_model_names or entry.name in modules:
            raise ValueError(f"--lora-modules: the name {entry.name!r} is used twice (adapters and the served "
                             "model need distinct names)")
        lora = modules.new_request(entry.name, entry.path, entry.base_model_name)
        engine_core.add_lora(lora)
        modules.add(lora)


__all__ = ["LoRAModulePath", "LoRAModules", "OpenAIServingLoRA", "register_static_loras",
           "runtime_updating_from_env"]

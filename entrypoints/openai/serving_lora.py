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
from typing import TYPE_CHECKING, Any

from fastapi.responses import PlainTextResponse

from halserve.engine.lora_names import already_loaded_message
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
    """The adapters a server offers, by name; each gets its own ``lora_int_id``.

    ``shared``: an engine-core client whose process keeps the names for every API server
    (``core/engine/lora_names.py``; ``halserve serve``'s default layout, and the only one with
    ``--api-server-count`` > 1): loads and unloads go through it and this object mirrors its list.
    None: this process keeps them (``--disable-frontend-multiprocessing``, tests)."""

    def __init__(self, allow_runtime_updates: bool = False, shared: Any = None) -> None:
        self.allow_runtime_updates = allow_runtime_updates
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._shared = shared if getattr(shared, "shares_lora_names", False) else None
        if self._shared is not None:
            self._shared.on_loras(self._mirror)

    def _mirror(self, loras: list[LoRARequest]) -> None:
        self._by_name = {lora.lora_name: lora for lora in loras}  # (one assignment: readers see old or new)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def get(self, name: str | None) -> LoRARequest | None:
        return self._by_name.get(name) if name is not None else None

    def values(self) -> list[LoRARequest]:
        return list(self._by_name.values())

    def register_static(self, engine_core, entry: LoRAModulePath) -> LoRARequest:
        """A ``--lora-modules`` entry, loaded and validated now (``engine_core.add_lora`` /
        ``engine_core.call_sync``); ValueError when it cannot be served."""
        if self._shared is not None:  # (each API server registers its flags: the same entry is the one there)
            return self._shared.call_sync("lora_register", entry.name, entry.path, entry.base_model_name, "static")
        lora = LoRARequest(entry.name, next(self._ids), entry.path, base_model_name=entry.base_model_name)
        engine_core.add_lora(lora)
        self._by_name[lora.lora_name] = lora
        return lora

    async def load(self, engine: Any, name: str, path: str, inplace: bool) -> LoRARequest:
        """Load adapter ``name`` (replacing one of that name if ``inplace``); ValueError when the name
        is taken (``already_loaded_message``) or the engine cannot serve it."""
        if self._shared is not None:
            return await self._shared.call("lora_register", name, path, None, "inplace" if inplace else "new")
        previous = self._by_name.get(name)
        if previous is not None and not inplace:
            raise ValueError(already_loaded_message(name))
        lora = LoRARequest(name, next(self._ids), path)
        await engine.add_lora(lora)
        self._by_name[name] = lora
        if previous is not None:
            await engine.remove_lora(previous.lora_int_id)
        return lora

    async def unload(self, engine: Any, name: str) -> LoRARequest | None:
        """Forget adapter ``name``; None if there is none of that name."""
        if self._shared is not None:
            return await self._shared.call("lora_unregister", name)
        lora = self._by_name.pop(name, None)
        if lora is not None:
            await engine.remove_lora(lora.lora_int_id)
        return lora


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
        if modules.get(name) is not None and not req.load_inplace:
            raise BadRequestError(already_loaded_message(name), param="lora_name")
        try:
            await modules.load(self.serving.engine, name, req.lora_path, req.load_inplace)
        except ValueError as exc:
            if str(exc) == already_loaded_message(name):  # (another API server loaded it meanwhile)
                raise BadRequestError(str(exc), param="lora_name") from None
            raise BadRequestError(str(exc), param="lora_path", code="invalid_lora_adapter") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, req: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        lora = await self.serving.lora_modules.unload(self.serving.engine, req.lora_name)
        if lora is None:
            raise NotFoundError(f"The lora adapter '{req.lora_name}' cannot be found.", param="lora_name")
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


def register_static_loras(engine_core, modules: LoRAModules, paths: list[LoRAModulePath],
                          served_model_names: list[str]) -> None:
    """``--lora-modules``, loaded and validated at startup (before the engine thread runs);
    ValueError naming the bad one."""
    seen: set[str] = set()
    for entry in paths:
        if entry.name in served_model_names or entry.name in seen:
            raise ValueError(f"--lora-modules: the name {entry.name!r} is used twice (adapters and the served "
                             "model need distinct names)")
        seen.add(entry.name)
        modules.register_static(engine_core, entry)


__all__ = ["LoRAModulePath", "LoRAModules", "OpenAIServingLoRA", "register_static_loras",
           "runtime_updating_from_env"]

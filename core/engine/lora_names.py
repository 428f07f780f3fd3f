"""The served LoRA adapters by name, kept by the engine-core process for every API server.

With ``--api-server-count N`` each API server is its own process; an adapter loaded at runtime
through one of them (``POST /v1/load_lora_adapter``) must be served by all, and two servers
loading different adapters must not give them the same ``lora_int_id``. So the engine-core
process, which all of them reach, owns the names and hands out the ids:

    API server A                        engine-core process                 API server B
    call lora_register(name, path) -->  id = next id; core.add_lora
                                        names[name] = LoRARequest
                                        ("loras", version, [...]) --------> view replaced
    <-- ("loras", ...), then the ack

Every client hears the new list before the caller hears its ack (one ordered socket each), so
the server that loaded an adapter serves it at once and the others a moment later (one frame).
A request can still race an unload on another server: the engine refuses a request whose
adapter is no longer registered under that name and id (``check``) instead of serving an
adapter that is gone. ``halserve serve --disable-frontend-multiprocessing`` (one process) keeps
the names in the API server (``entrypoints/openai/serving_lora.py``), as before.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from halserve.lora.request import LoRARequest

if TYPE_CHECKING:  # pragma: no cover
    from halserve.engine.core import EngineCore

__all__ = ["LORA_NAME_METHODS", "SharedLoRANames", "already_loaded_message"]

# What a client may call on the registry by name (``("call", ack, method, args)``); each one that
# changes it is followed by a ``("loras", version, [LoRARequest, ...])`` frame to every client.
LORA_NAME_METHODS = frozenset({"lora_register", "lora_unregister", "lora_snapshot"})


def already_loaded_message(name: str) -> str:
    return f"The lora adapter '{name}' has already been loaded."  # (vLLM's words)


class SharedLoRANames:
    """``lora_register`` / ``lora_unregister`` (the clients' calls), ``snapshot`` and ``check``."""

    MODES = ("static", "new", "inplace")

    def __init__(self, core: EngineCore | Any) -> None:
        self.core = core
        self.by_name: dict[str, LoRARequest] = {}
        self.version = 0
        self._next_id = 1
        self._ever: set[str] = set()  # names registered at some time (``check`` leaves the others alone)

    def lora_register(self, name: str, path: str, base_model_name: str | None, mode: str) -> LoRARequest:
        """Load ``path`` as adapter ``name`` and return its request. ``mode``: ``static`` (a server's
        ``--lora-modules`` entry: the same name and path again is the one already there, as each API
        server registers its flags), ``new`` (ValueError if the name is taken) or ``inplace`` (replace
        the adapter of that name). ValueError when the engine cannot serve it; nothing changes then."""
        if mode not in self.MODES:
            raise ValueError(f"lora_register: mode {mode!r} is not one of {', '.join(self.MODES)}")
        previous = self.by_name.get(name)
        if previous is not None:
            if mode == "static" and previous.lora_path == path and previous.base_model_name == base_model_name:
                return previous
            if mode != "inplace":
                raise ValueError(already_loaded_message(name))
        lora = LoRARequest(name, self._next_id, path, base_model_name=base_model_name)
        self.core.add_lora(lora)  # (ValueError: the id is not handed out)
        self._next_id += 1
        self.by_name[name] = lora
        self._ever.add(name)
        self.version += 1
        if previous is not None:
            self.core.remove_lora(previous.lora_int_id)
        return lora

    def lora_unregister(self, name: str) -> LoRARequest | None:
        """Forget adapter ``name``; None if there is none of that name."""
        lora = self.by_name.pop(name, None)
        if lora is not None:
            self.version += 1
            self.core.remove_lora(lora.lora_int_id)
        return lora

    def lora_snapshot(self) -> tuple[int, list[LoRARequest]]:
        return self.version, list(self.by_name.values())

    def check(self, lora: LoRARequest | None) -> None:
        """ValueError when a request names an adapter registered here that is not (or no longer) served as
        given. Adapters never registered by name (a Python caller's own ``LoRARequest``) pass."""
        if lora is not None and lora.lora_name in self._ever and self.by_name.get(lora.lora_name) != lora:
            raise ValueError(f"the LoRA adapter '{lora.lora_name}' was unloaded or replaced while the request was on "
                             "its way; send it again (GET /v1/models lists the adapters served now)")

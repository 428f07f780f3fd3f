"""The LoRA adapters' names kept by the engine-core process for every API server
(core/engine/lora_names.py): one id per adapter across servers, every client's view updated
before the loading call returns, a request racing an unload refused instead of served."""
from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import pytest

from halserve.engine.lora_names import SharedLoRANames, already_loaded_message
from halserve.engine.types import EngineCoreRequest, EngineStats
from halserve.lora.request import LoRARequest
from halserve.sampling_params import SamplingParams


class FakeCore:
    """What the registry and the engine-core loop use of an ``EngineCore``; adapters whose path
    starts with ``/bad`` are refused as the real one refuses an adapter it cannot serve."""

    def __init__(self) -> None:
        self.loaded: dict[int, str] = {}
        self.added: list[str] = []

    def add_lora(self, lora: LoRARequest) -> bool:
        if lora.lora_path.startswith("/bad"):
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: {lora.lora_path} is not a directory")
        self.loaded[lora.lora_int_id] = lora.lora_path
        return True

    def remove_lora(self, lora_id: int) -> bool:
        return self.loaded.pop(lora_id, None) is not None

    def add_request(self, request) -> None:
        self.added.append(request.request_id)

    def abort_requests(self, request_ids) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return False

    def get_stats(self) -> EngineStats:
        return EngineStats()

    def step(self) -> list:
        return []

    def shutdown(self) -> None:
        pass


def test_ids_are_unique_and_modes_behave():
    core = FakeCore()
    names = SharedLoRANames(core)
    a = names.lora_register("a", "/x/a", None, "static")
    assert names.lora_register("a", "/x/a", None, "static") is a  # (a second API server's same flag)
    b = names.lora_register("b", "/x/b", "base", "new")
    assert (a.lora_int_id, b.lora_int_id) == (1, 2) and b.base_model_name == "base"
    with pytest.raises(ValueError, match="has already been loaded"):
        names.lora_register("a", "/x/other", None, "new")
    with pytest.raises(ValueError, match="has already been loaded"):
        names.lora_register("a", "/x/other", None, "static")  # (same name, another path: not the same flag)
    with pytest.raises(ValueError, match="not a directory"):
        names.lora_register("c", "/bad/c", None, "new")
    assert "c" not in names.by_name and names.version == 2  # a refused load changes nothing
    a2 = names.lora_register("a", "/x/a2", None, "inplace")
    assert a2.lora_int_id == 3 and core.loaded == {2: "/x/b", 3: "/x/a2"}  # the replaced one is dropped
    assert names.lora_unregister("b") == b and names.lora_unregister("b") is None
    assert core.loaded == {3: "/x/a2"}
    version, loras = names.lora_snapshot()
    assert version == 4 and loras == [a2]
    with pytest.raises(ValueError, match="mode"):
        names.lora_register("d", "/x/d", None, "maybe")


def test_check_refuses_requests_for_adapters_gone_or_replaced():
    names = SharedLoRANames(FakeCore())
    a = names.lora_register("a", "/x/a", None, "new")
    names.check(a)
    names.check(None)
    names.check(LoRARequest("never-registered", 7, "/own/path"))  # a Python caller's own adapter
    names.lora_register("a", "/x/a2", None, "inplace")
    with pytest.raises(ValueError, match="unloaded or replaced"):
        names.check(a)
    names.lora_unregister("a")
    with pytest.raises(ValueError, match="unloaded or replaced"):
        names.check(a)


@pytest.fixture
def engine_proc(tmp_path):
    """An ``EngineCoreProc`` over a fake core, serving in a thread; yields (its socket path, the core)."""
    from halserve.engine.core_proc import EngineCoreProc

    path = str(tmp_path / "core.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    core = FakeCore()
    proc = EngineCoreProc(core, listener)
    thread = threading.Thread(target=proc.run, daemon=True)
    thread.start()
    yield path, core
    proc.stopping.append("shutdown")
    thread.join(5)
    assert not thread.is_alive()


def _wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_two_api_servers_share_one_registry(engine_proc):
    """Two clients (two API servers): an adapter loaded through one is in the other's view, the ids
    never collide, an unload through one removes it from both, and a request that still names the
    unloaded adapter is refused by the engine with a clear error."""
    from halserve.engine.core_client import MPEngineCoreClient
    from halserve.entrypoints.openai.serving_lora import LoRAModulePath, LoRAModules

    path, core = engine_proc
    one, two = MPEngineCoreClient(path, None), MPEngineCoreClient(path, None)
    try:
        mods_one, mods_two = LoRAModules(True, shared=one), LoRAModules(True, shared=two)
        # each server registers the same --lora-modules flag: one adapter, one id
        static = [mods.register_static(None, LoRAModulePath("sql", "/x/sql")) for mods in (mods_one, mods_two)]
        assert static[0] == static[1] and list(core.loaded) == [static[0].lora_int_id]

        async def scenario():
            for client in (one, two):
                client.start()
            x = await mods_one.load(None, "x", "/x/x", inplace=False)
            assert mods_one.get("x") == x  # the caller's own view has it when the call returns
            y = await mods_two.load(None, "y", "/x/y", inplace=False)
            assert len({static[0].lora_int_id, x.lora_int_id, y.lora_int_id}) == 3
            _wait_for(lambda: "y" in mods_one and "x" in mods_two)
            with pytest.raises(ValueError, match="has already been loaded"):
                await mods_two.load(None, "x", "/x/x", inplace=False)
            with pytest.raises(ValueError, match="not a directory"):
                await mods_two.load(None, "z", "/bad/z", inplace=False)
            assert await mods_two.unload(None, "x") == x
            assert await mods_two.unload(None, "x") is None
            _wait_for(lambda: "x" not in mods_one)
            # a request that still carries the unloaded adapter (it raced the unload) is refused
            request = EngineCoreRequest("r1", "r1", 0, [1, 2, 3], SamplingParams(max_tokens=2), set(), 2, 0.0,
                                        lora_request=x)
            error = await one.add_requests([request])
            assert isinstance(error, ValueError) and "unloaded or replaced" in str(error)
            ok = EngineCoreRequest("r2", "r2", 0, [1, 2, 3], SamplingParams(max_tokens=2), set(), 2, 0.0,
                                   lora_request=y)
            assert await one.add_requests([ok]) is None and core.added == ["r2"]
            assert sorted(lora.lora_name for lora in mods_one.values()) == ["sql", "y"]

        asyncio.run(scenario())
    finally:
        one.close_sync()
        two.close_sync()
    assert os.path.exists(path)  # (the clients did not own the engine: they left its socket alone)


def test_already_loaded_message_is_vllms():
    assert already_loaded_message("dyn") == "The lora adapter 'dyn' has already been loaded."

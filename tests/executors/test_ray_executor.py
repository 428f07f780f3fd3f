"""The ``ray`` executor: Ray actors in a placement group, real torch.distributed (gloo), tensor
parallelism end to end on CPU. One engine is shared by the module: its executor starts the
local Ray instance (the slow part) that the other tests reuse; the last test kills one of its
actors and shuts it down."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import psutil
import pytest
from engine_helpers import (
    assert_greedy_matches_one_rank,
    assert_seeded_sampling_is_reproducible,
    generate_ids,
    greedy_params,
    hf_greedy,
)

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')

NEW_TOKENS = 12
ENGINE_KWARGS = dict(platform="cpu", dtype="float32", block_size=16, max_num_batched_tokens=64,
                     num_kv_blocks=64, max_num_seqs=8)


def _greedy(max_tokens: int = NEW_TOKENS):
    return greedy_params(max_tokens)


def _executor_of(llm):
    return llm.llm_engine.core.executor


def _is_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# -- run in the actors through collective_rpc (pickled by value: the actors cannot import this module) --
def _attention_layout(worker) -> tuple:
    """(local q heads, local kv heads) of the worker's first layer."""
    layer = worker.model_runner.model.attention_layers[0]
    return layer.num_heads, layer.num_kv_heads


def _process_env(worker) -> tuple:
    return worker.rank, os.getpid(), os.environ.get("LOCAL_RANK"), os.environ.get("HALSERVE_CPU_THREADS")


def _raise_on_rank(worker, rank: int) -> int:
    if worker.rank == rank:
        raise ValueError(f"bad value on rank {worker.rank}")
    return worker.rank


@pytest.fixture(scope="module")
def ray_llm(llama):
    """A tensor_parallel_size=2 engine on the ray executor, which starts a local Ray (one CPU per
    rank: a 2-CPU machine holds both bundles)."""
    ray = pytest.importorskip("ray")
    from halserve import LLM

    path, _ = llama
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RAY_ADDRESS", raising=False)
        mp.setenv("HALSERVE_CPU_THREADS", "1")
        llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE_KWARGS)
    yield llm
    llm.llm_engine.shutdown()


def test_ray_is_registered_and_listed(capsys):
    from halserve.entrypoints.cli import main
    from halserve.executors.ray import RayExecutor
    from halserve.plugins import get_plugin_manager

    assert get_plugin_manager().executors["ray"].obj is RayExecutor
    assert main(["plugins", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)["executors"]}
    assert rows["ray"]["supports_multiple_ranks"] is True
    assert rows["ray"]["description"] == RayExecutor.description


def test_missing_ray_is_a_clear_error(llama, monkeypatch):
    from halserve import LLM

    path, _ = llama
    monkeypatch.setitem(sys.modules, "ray", None)  # "import ray" now raises ImportError
    with pytest.raises(ImportError, match=r'needs Ray.*pip install "halserve\[ray\]"'):
        LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE_KWARGS)


@pytest.mark.parametrize("name, value", [("HALSERVE_RAY_PLACEMENT_STRATEGY", "anywhere"),
                                         ("HALSERVE_RAY_PG_TIMEOUT_S", "-1"), ("HALSERVE_RAY_RPC_TIMEOUT_S", "soon")])
def test_bad_settings_are_clear_errors(llama, monkeypatch, name, value):
    """Checked before Ray is started or joined."""
    pytest.importorskip("ray")
    from halserve import LLM

    path, _ = llama
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}='{value}'"):
        LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE_KWARGS)


def test_actors_fill_a_placement_group(ray_llm):
    import ray

    from halserve.executors.ray import RayExecutor

    executor = _executor_of(ray_llm)
    assert isinstance(executor, RayExecutor)
    executor.check_health()
    pids = executor.worker_pids
    assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    pg = ray.util.placement_group_table(executor._pg)
    assert pg["state"] == "CREATED" and pg["strategy"] == "PACK"
    assert list(pg["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}]
    # one process per rank, both on this node: local ranks 0 and 1, the thread count passed on
    assert executor.collective_rpc(_process_env) == [(0, pids[0], "0", "1"), (1, pids[1], "1", "1")]
    # each rank holds half the q heads and one of the two kv heads
    assert executor.collective_rpc(_attention_layout) == [(2, 1), (2, 1)]


def test_greedy_matches_tp1_and_transformers(llama, ray_llm):
    path, prompts = llama
    assert_greedy_matches_one_rank(path, prompts, ray_llm, NEW_TOKENS, "ray tp=2", **ENGINE_KWARGS)


def test_seeded_sampling_is_reproducible(llama, ray_llm):
    """The ranks must agree on every sampled token (checked each step) and a seeded request
    gives the same tokens every time, whatever the batch order."""
    _, prompts = llama
    assert_seeded_sampling_is_reproducible(ray_llm, prompts)


def test_worker_error_names_the_rank_and_leaves_the_engine_usable(llama, ray_llm):
    _, prompts = llama
    executor = _executor_of(ray_llm)
    with pytest.raises(ValueError, match="bad value on rank 1") as info:
        executor.collective_rpc(_raise_on_rank, 1)
    assert any("worker rank 1" in note for note in info.value.__notes__)
    assert "_raise_on_rank" in str(info.value.__cause__)  # the worker's traceback
    with pytest.raises(AttributeError, match="no_such_method"):  # every rank fails alike
        executor.collective_rpc("no_such_method")
    # every rank answered both calls: nothing is stuck, so the executor stays usable
    executor.check_health()
    assert executor.collective_rpc(_raise_on_rank, 5) == [0, 1]
    assert [len(t) for t in generate_ids(ray_llm, prompts[:2], _greedy(3))] == [3, 3]


def test_unplaceable_ranks_are_a_clear_error(llama, ray_llm, monkeypatch):
    """4 ranks of 2 CPUs each on a Ray instance of 2 CPUs (both held by the shared engine)."""
    import ray

    from halserve import LLM

    path, _ = llama
    monkeypatch.setenv("HALSERVE_RAY_PG_TIMEOUT_S", "3")
    monkeypatch.setenv("HALSERVE_CPU_THREADS", "2")
    before = set(ray.util.placement_group_table())
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"could not place 4 ranks of \{'CPU': 2\.0\} each .* within 3s.*'CPU': 2\.0"):
        LLM(path, tensor_parallel_size=4, distributed_executor_backend="ray", **ENGINE_KWARGS)
    assert time.monotonic() - start < 60
    new = {pg_id: pg for pg_id, pg in ray.util.placement_group_table().items() if pg_id not in before}
    assert len(new) == 1 and all(pg["state"] == "REMOVED" for pg in new.values()), new
    assert ray.is_initialized()  # the shared engine's Ray, not this executor's to stop
    _executor_of(ray_llm).check_health()


def test_actor_death_raises_and_shutdown_leaves_no_workers(llama, ray_llm):
    """Runs last: it kills one of the shared engine's actors."""
    import ray

    from halserve.executors.base import WorkerDiedError

    _, prompts = llama
    executor = _executor_of(ray_llm)
    pids = executor.worker_pids
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(pid \d+\) died .*restart the engine"):
        generate_ids(ray_llm, prompts[:1], _greedy(2))
    assert time.monotonic() - start < 30, "a dead actor must be reported, not waited for"
    with pytest.raises(WorkerDiedError, match="rank 1"):
        executor.check_health()
    with pytest.raises(WorkerDiedError, match="unusable"):
        executor.execute_model(None)  # every later call fails at once, before sending anything
    ray_llm.llm_engine.shutdown()
    deadline = time.monotonic() + 20
    while not all(_is_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_is_gone(p) for p in pids), "shutdown must stop every actor"
    if executor._owns_ray:  # (it did unless something else in this process started Ray first)
        assert not ray.is_initialized(), "the executor started Ray, so its shutdown stops it"
    executor.shutdown()  # idempotent
    with pytest.raises(WorkerDiedError, match="shut down"):
        executor.collective_rpc("attention_backend_name")


def test_pipeline_stages_as_ray_actors(llama):
    """Two pipeline stages as two actors (after the shared engine is gone: its bundles held both CPUs);
    the second stage's actor answers for the engine."""
    import ray

    from halserve import LLM

    path, prompts = llama
    assert not ray.is_initialized()
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RAY_ADDRESS", raising=False)
        mp.setenv("HALSERVE_CPU_THREADS", "1")
        llm = LLM(path, pipeline_parallel_size=2, distributed_executor_backend="ray", **ENGINE_KWARGS)
    try:
        executor = _executor_of(llm)
        assert executor.output_rank == 1
        assert executor.collective_rpc(_stage_of) == [0, 1]
        assert generate_ids(llm, prompts, _greedy()) == hf_greedy(path, prompts, NEW_TOKENS)
    finally:
        llm.llm_engine.shutdown()
    assert not ray.is_initialized()


def _stage_of(worker) -> int:
    return worker.model_runner.pp.rank

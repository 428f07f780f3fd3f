"""The ``ray`` executor: one Ray actor per rank, in a placement group, on this machine or a Ray cluster.

    engine process                         Ray actors (bundle i of the placement group = rank i)
    RayExecutor ──execute_method.remote──▶ rank 0: _RayWorkerWrapper ─ Worker ─┐
                ──execute_method.remote──▶ rank 1: _RayWorkerWrapper ─ Worker ─┼─ torch.distributed
                ...                                                            ┘  tcp://<rank 0 ip>:<port>

Ray is joined (``RAY_ADDRESS``) or started locally when the process has not done it already,
and shut down with the executor only when the executor started it. The placement group holds
one bundle per rank: ``{"CPU": threads}`` on CPU platforms (``HALSERVE_CPU_THREADS``, else the
cluster's CPUs split between the ranks), one accelerator otherwise (Ray then makes only that
device visible to the actor). ``HALSERVE_RAY_PLACEMENT_STRATEGY`` (default PACK) and
``HALSERVE_RAY_PG_TIMEOUT_S`` (default 60) tune the placement; ``HALSERVE_RAY_RPC_TIMEOUT_S``
bounds every call (default: wait while the actors live).

Calls behave as the ``mp`` executor's: submitted to every rank, then gathered in rank order so
collectives inside them meet; a rank's exception is re-raised with its type, the rank named
in a note and the worker's traceback as cause; a dead actor raises ``WorkerDiedError`` and
leaves the executor unusable; the ranks other than the output rank answer ``execute_model``
with their sampled token ids only, which ``pick_output`` checks.
"""
from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from halserve.executors.base import Executor, RemoteTraceback, WorkerDiedError

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig
    from halserve.models.loader import ModelInfo
    from halserve.scheduler_output import ModelRunnerOutput, SchedulerOutput
    from halserve.worker.worker import Worker

logger = logging.getLogger(__name__)

# Once one rank failed a call, how long the others get to answer (they may be stuck in a
# collective waiting for the failed one) before the executor gives up on them.
_ERROR_GRACE_S = 5.0
# How long check_health waits for every actor's ping.
_HEALTH_TIMEOUT_S = 30.0
_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def import_ray():
    """The ``ray`` module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError('the "ray" executor (--distributed-executor-backend ray) needs Ray, which is not '
                          'installed: pip install "halserve[ray]"') from exc
    return ray


def _env_float(name: str, default: float | None) -> float | None:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ValueError(f"{name}={value!r} must be a positive number of seconds")
    return seconds


class _RayWorkerWrapper:
    """The actor class (wrapped by ``ray.remote`` when the executor starts): holds one rank's
    ``Worker``, built by ``init_worker`` once every rank's placement is known."""

    def __init__(self) -> None:
        self.worker: Worker | None = None

    def node_info(self) -> dict[str, Any]:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "pid": os.getpid()}

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def init_worker(self, config: EngineConfig, platform_name: str, model_info: ModelInfo, rank: int, world_size: int,
                    init_method: str, env: dict[str, str]) -> None:
        os.environ.update(env)
        from halserve.worker.worker import Worker

        self.worker = Worker(config, platform_name, model_info, rank=rank, world_size=world_size,
                             distributed_init_method=init_method)

    def execute_method(self, method: str | Callable[..., Any], args: tuple, kwargs: dict, tokens_only: bool) -> Any:
        if callable(method):  # a picklable function of the worker (tests, debugging)
            result = method(self.worker, *args, **kwargs)
        else:
            result = getattr(self.worker, method)(*args, **kwargs)
        if tokens_only:
            result = None if result is None else result.sampled_token_ids
        return result

    def ping(self) -> bool:
        return True


class RayExecutor(Executor):
    name = "ray"
    supports_multiple_ranks = True
    description = "one Ray actor per rank in a placement group, on this machine or a Ray cluster"

    def __init__(self, config: EngineConfig, platform_name: str, model_info: ModelInfo) -> None:
        super().__init__(config, platform_name, model_info)
        ray = import_ray()
        self._failure: str | None = None  # why the executor is unusable, once it is
        self._is_shut_down = False
        self._owns_ray = False  # whether this executor called ray.init (then it calls ray.shutdown)
        self._pg: Any = None  # ray's PlacementGroup, once reserved
        self._actors: list = []
        self._pids: list[int] = []
        self._ips: list[str] = []
        self.rpc_timeout_s = _env_float("HALSERVE_RAY_RPC_TIMEOUT_S", None)  # None: wait while actors live
        pg_timeout_s = _env_float("HALSERVE_RAY_PG_TIMEOUT_S", 60.0)
        assert pg_timeout_s is not None  # (a default is given)
        strategy = os.environ.get("HALSERVE_RAY_PLACEMENT_STRATEGY") or "PACK"
        if strategy.upper() not in _PLACEMENT_STRATEGIES:
            raise ValueError(f"HALSERVE_RAY_PLACEMENT_STRATEGY={strategy!r} is not one of {_PLACEMENT_STRATEGIES}")
        strategy = strategy.upper()
        threads = os.environ.get("HALSERVE_CPU_THREADS")
        if threads and (not threads.isdigit() or int(threads) < 1):
            raise ValueError(f"HALSERVE_CPU_THREADS={threads!r} must be a positive number of threads per rank")
        atexit.register(self.shutdown)
        try:
            if not ray.is_initialized():
                address = os.environ.get("RAY_ADDRESS") or "local"
                ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
                self._owns_ray = True
            # Split the cluster's CPUs between the ranks unless the user chose a per-rank thread count.
            threads = threads or str(max(1, int(ray.cluster_resources().get("CPU", 1)) // self.world_size))
            bundle = self._bundle(int(threads))
            self._place(ray, bundle, strategy, pg_timeout_s)
            self._start_actors(ray, bundle, threads)
        except BaseException:
            self.shutdown()
            raise
        logger.info("ray executor: %d actors (pids %s on %s), bundles of %s",
                    self.world_size, self._pids, sorted(set(self._ips)), bundle)

    # -- start-up --------------------------------------------------------------------
    def _bundle(self, threads: int) -> dict[str, float]:
        """What one rank asks of the cluster: its CPU threads, or one of the platform's devices."""
        from halserve.plugins import get_plugin_manager

        reg = get_plugin_manager().platforms.get(self.platform_name)
        assert reg is not None, f"platform {self.platform_name!r} is not registered"
        key = reg.obj.ray_device_key
        return {"CPU": float(threads)} if key == "CPU" else {key: 1.0}

    def _place(self, ray, bundle: dict[str, float], strategy: str, timeout_s: float) -> None:
        """Reserve ``world_size`` bundles (``self._pg``, removed by shutdown if anything fails
        later), or raise a ValueError saying what is missing."""
        from ray.util.placement_group import placement_group, remove_placement_group

        self._pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy=strategy)
        if not self._pg.wait(timeout_seconds=timeout_s):
            remove_placement_group(self._pg)
            self._pg = None
            have = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU", "TPU") or k in bundle}
            available = ray.available_resources()
            free = {k: available.get(k, 0.0) for k in have}
            raise ValueError(
                f"the Ray cluster could not place {self.world_size} ranks of {bundle} each (strategy {strategy}) "
                f"within {timeout_s:g}s (HALSERVE_RAY_PG_TIMEOUT_S): it has {have} in all, {free} free. "
                "Use fewer ranks, lower HALSERVE_CPU_THREADS, free or add resources, or try "
                "HALSERVE_RAY_PLACEMENT_STRATEGY=SPREAD"
            )

    def _start_actors(self, ray, bundle: dict[str, float], threads: str) -> None:
        """One actor per bundle; then each builds its Worker, with rank 0's node as the rendezvous."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_cls = ray.remote(_RayWorkerWrapper)
        resources = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self._pg, placement_group_bundle_index=rank)
            self._actors.append(actor_cls.options(
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), resources=resources,
                scheduling_strategy=strategy,
            ).remote())
        infos = self._gather([a.node_info.remote() for a in self._actors], "node_info")
        self._pids = [info["pid"] for info in infos]
        self._ips = [info["ip"] for info in infos]
        (port,) = self._gather([self._actors[0].free_port.remote()], "free_port")
        host = f"[{self._ips[0]}]" if ":" in self._ips[0] else self._ips[0]
        init_method = f"tcp://{host}:{port}"
        # LOCAL_RANK: the actor's index among the actors on its node, by rank.
        seen: Counter = Counter()
        local_ranks = []
        for info in infos:
            local_ranks.append(seen[info["node_id"]])
            seen[info["node_id"]] += 1
        config_ref, model_info_ref = ray.put(self.config), ray.put(self.model_info)
        self._gather([
            actor.init_worker.remote(config_ref, self.platform_name, model_info_ref, rank, self.world_size,
                                     init_method, {"HALSERVE_CPU_THREADS": threads, "LOCAL_RANK": str(local_rank)})
            for rank, (actor, local_rank) in enumerate(zip(self._actors, local_ranks))
        ], "init_worker")

    # -- calls -----------------------------------------------------------------------
    @property
    def worker_pids(self) -> list[int]:
        """The actors' process ids, by rank (still known after shutdown)."""
        return list(self._pids)

    def collective_rpc(self, method: str | Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``Worker.<method>(*args, **kwargs)`` on every rank, results by rank. ``method`` may
        also be a picklable function, called as ``method(worker, *args, **kwargs)``.
        A rank's exception is re-raised here (its traceback as the cause)."""
        return self._gather(self._submit(method, args, kwargs, full_reply_rank=None), method)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect_model(self.submit_model(scheduler_output))

    # -- overlapped steps: one in flight per pipeline stage (an actor runs its calls in order) --
    @property
    def max_concurrent_batches(self) -> int:
        return self.config.pipeline_parallel_size

    def submit_model(self, scheduler_output: SchedulerOutput) -> list:
        return self._submit("execute_model", (scheduler_output,), {}, full_reply_rank=self.output_rank)

    def collect_model(self, refs: list) -> ModelRunnerOutput:
        results = self._gather(refs, "execute_model")
        try:
            return self.pick_output(results)
        except RuntimeError as exc:
            self._failure = str(exc)
            raise

    def check_health(self) -> None:
        self._raise_if_failed()
        self._gather([a.ping.remote() for a in self._actors], "check_health", timeout_s=_HEALTH_TIMEOUT_S)

    # -- plumbing --------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._is_shut_down:
            raise WorkerDiedError(f"the {self.name!r} executor was shut down")
        if self._failure is not None:
            raise WorkerDiedError(f"the {self.name!r} executor is unusable: {self._failure}")

    def _submit(self, method, args: tuple, kwargs: dict, full_reply_rank: int | None) -> list:
        """Submit the call to every rank; with ``full_reply_rank`` set (``execute_model``), the
        other ranks answer with only their sampled token ids."""
        self._raise_if_failed()
        return [actor.execute_method.remote(method, args, kwargs, full_reply_rank not in (None, rank))
                for rank, actor in enumerate(self._actors)]

    def _gather(self, refs: list, method, timeout_s: float | None = None) -> list[Any]:
        """Each rank's answer (``refs`` by rank), in rank order; raises the first rank's error.
        A rank that dies raises ``WorkerDiedError`` at once; once one rank failed, the others
        get ``_ERROR_GRACE_S`` to answer."""
        import ray
        from ray.exceptions import RayError, RayTaskError

        method = getattr(method, "__name__", method)
        timeout_s = timeout_s or self.rpc_timeout_s
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        errors: dict[int, RayTaskError] = {}
        start = time.monotonic()
        first_error_at: float | None = None
        try:
            while pending:
                deadline = None if timeout_s is None else start + timeout_s
                if first_error_at is not None:
                    grace_end = first_error_at + _ERROR_GRACE_S
                    deadline = grace_end if deadline is None else min(deadline, grace_end)
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
                if not ready:
                    if first_error_at is not None:
                        break  # the others are stuck behind the failed rank
                    self._failure = (f"{method!r} got no answer from ranks {sorted(pending.values())} within "
                                     f"{timeout_s:g}s; restart the engine")
                    raise WorkerDiedError(self._failure)
                for ref in ready:
                    rank = pending.pop(ref)
                    try:
                        results[rank] = ray.get(ref)
                    except RayTaskError as exc:
                        errors[rank] = exc
                        first_error_at = first_error_at or time.monotonic()
                    except RayError as exc:  # the actor died or is unreachable (ActorDiedError, ...)
                        self._fail(rank, f"died during {method!r}", exc)
        except BaseException:
            # A dead rank, a timeout, Ctrl-C: ranks that did not answer may be stuck in a collective.
            if self._failure is None and pending:
                self._failure = f"{method!r} was interrupted before every rank answered"
            raise
        if errors:
            rank = min(errors)
            failed = errors[rank]
            cause = failed.cause
            summary = f"{type(cause).__name__}: {cause}"
            if pending or method == "execute_model":
                # other ranks are stuck in (or went past) a collective the failed one left
                self._failure = f"worker rank {rank} failed in {method!r}: {summary}"
            if not isinstance(cause, BaseException) or isinstance(cause, RayError):  # not picklable
                cause = RuntimeError(f"worker rank {rank} failed in {method!r}: {summary}")
            if sys.version_info >= (3, 11):  # (no exception notes on 3.10)
                cause.add_note(f"(raised in {method!r} by worker rank {rank} of the ray executor)")
            raise cause from RemoteTraceback(f"\n(worker rank {rank})\n{failed}")
        return [results[r] for r in range(len(refs))]

    def _fail(self, rank: int, what: str, exc: BaseException) -> NoReturn:
        detail = " ".join(str(exc).split())
        if len(detail) > 500:
            detail = detail[:500] + " ..."
        pid = self._pids[rank] if rank < len(self._pids) else "unknown"
        self._failure = f"worker rank {rank} (pid {pid}) {what} ({type(exc).__name__}: {detail}); restart the engine"
        raise WorkerDiedError(self._failure) from exc

    # -- lifecycle -------------------------------------------------------------------
    def shutdown(self) -> None:
        """Kill the actors, remove the placement group, and stop Ray if this executor started it.
        Idempotent."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        atexit.unregister(self.shutdown)
        import ray

        if not ray.is_initialized():  # Ray's own atexit hook ran first: it took everything down
            return
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        self._actors = []
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._pg)
            except Exception:
                logger.warning("ray executor: could not remove placement group %s", self._pg.id.hex())
            self._pg = None
        if self._owns_ray:
            ray.shutdown()

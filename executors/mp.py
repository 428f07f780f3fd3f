"""The ``mp`` executor: one worker process per rank (tensor x pipeline parallel) on this machine.

    engine process                                   worker processes ("spawn")
    MultiprocExecutor ──Pipe──▶ rank 0: Worker ─┐
                      ──Pipe──▶ rank 1: Worker ─┼─ torch.distributed (platform's dist_backend,
                      ...                       ┘   tcp://127.0.0.1:<free port>)

``collective_rpc(method, ...)`` sends ``(method, args, kwargs)`` to every rank first and
then gathers the replies in rank order, so collectives inside the call (process-group
rendezvous, all-reduces in the forward) can meet. Waiting is on the pipes *and* the
processes' sentinels: a rank that dies is reported at once instead of hanging the engine.

Every rank keeps the same request state. The last pipeline stage's ranks sample the same
tokens: the LM head all-gathers the full logits on every rank of the stage, every rank seeds
its generators alike, so the sampler sees identical inputs. Only the output rank sends back
its whole ``ModelRunnerOutput``; the other ranks send their sampled token ids (None before the
last stage), which are checked against the output rank's (a mismatch would silently corrupt
later steps).

Scripts that build an engine with this executor need the ``if __name__ == "__main__":``
guard, as for any "spawn" multiprocessing: each worker imports the main module.
"""
from __future__ import annotations

import atexit
import itertools
import logging
import os
import pickle
import socket
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from halserve.executors.base import Executor, RemoteTraceback, WorkerDiedError

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig
    from halserve.models.loader import ModelInfo
    from halserve.scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_SHUTDOWN = "__shutdown__"
# Async scheduling: a step is sent as ``_DEFERRED_STEP``; each rank launches it and replies with the
# step before's output (none after the first), so step N's reply travels while step N + 1 runs.
# The last step's reply is held until the next step or ``_TAKE_DEFERRED`` (worker/async_output.py).
_DEFERRED_STEP = "execute_model_deferred"
_TAKE_DEFERRED = "take_deferred_output"
# Once one rank failed a call, how long the others get to answer (they may be stuck in a
# collective waiting for the failed one) before the executor gives up on them.
_ERROR_GRACE_S = 5.0
# How long shutdown waits for a graceful exit before terminating, then killing.
_JOIN_TIMEOUT_S = 5.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _num_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _defers_outputs(platform_name: str) -> bool:
    """Whether async scheduling sends steps as ``_DEFERRED_STEP``. On a device whose kernels run
    asynchronously, yes: a rank answers step N right after launching step N + 1. On the CPU a launch
    runs the whole forward, so that answer would wait for it: the ranks answer each step as it ends
    instead, and the engine processes it while the next step runs (measured: W2 offline, 2 cores,
    BENCHMARKS.md). ``HALSERVE_MP_DEFER_OUTPUTS=1`` (or ``0``) forces the choice (the CPU tests)."""
    forced = os.environ.get("HALSERVE_MP_DEFER_OUTPUTS")
    if forced in ("0", "1"):
        return forced == "1"
    return platform_name != "cpu"


def _error_reply(exc: BaseException) -> tuple:
    """("error", pickled exception or None, one-line summary, formatted traceback)."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        payload = pickle.dumps(exc)
        pickle.loads(payload)  # some exceptions pickle but cannot be rebuilt
    except Exception:
        payload = None
    return ("error", payload, f"{type(exc).__name__}: {exc}", tb)


def _worker_main(conn: Any, config: EngineConfig, platform_name: str, model_info: ModelInfo, rank: int, world_size: int,
                 init_method: str, env: dict[str, str]) -> None:
    """Entry point of one worker process: build the Worker and serve calls until told to stop
    (or until the engine's end of the pipe closes, i.e. the engine process is gone)."""
    import signal

    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the engine, which shuts us down
    from halserve.distributed import destroy_distributed
    from halserve.worker.worker import Worker

    worker = Worker(config, platform_name, model_info, rank=rank, world_size=world_size,
                    distributed_init_method=init_method)
    try:
        while True:
            try:
                method, args, kwargs, tokens_only = conn.recv()
            except (EOFError, OSError):
                break  # the engine is gone
            if method == _SHUTDOWN:
                conn.send(("ok", None))
                break
            try:
                if callable(method):  # a picklable function of the worker (tests, debugging)
                    result = method(worker, *args, **kwargs)
                else:
                    result = getattr(worker, method)(*args, **kwargs)
                if method == _DEFERRED_STEP:  # the reply is the step before's output, if one was pending
                    had_previous, result = result
                    if not had_previous:
                        continue
                if tokens_only:
                    result = None if result is None else result.sampled_token_ids
                reply = ("ok", result)
            except BaseException as exc:  # reported to the engine, which decides
                reply = _error_reply(exc)
            try:
                conn.send(reply)
            except (EOFError, OSError):
                break
    finally:
        try:
            destroy_distributed()
        finally:
            conn.close()
    # Nothing of a worker's needs tearing down beyond this point, and interpreter teardown
    # with torch loaded takes seconds on a busy machine: flush what was printed and leave.
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(0)


class MultiprocExecutor(Executor):
    name = "mp"
    supports_multiple_ranks = True
    # (submit_model returns at once; each rank keeps the step's sampled ids on its device and answers the
    # step before: _DEFERRED_STEP)
    supports_async_scheduling = True
    description = "one worker process per rank on this machine, torch.distributed with the platform's backend"

    def __init__(self, config: EngineConfig, platform_name: str, model_info: ModelInfo) -> None:
        super().__init__(config, platform_name, model_info)
        import multiprocessing

        self._failure: str | None = None  # why the executor is unusable, once it is
        self._is_shut_down = False
        self._conns: list = []
        self._procs: list = []
        self._pids: list[int] = []
        self._tickets = itertools.count()
        self._pending_steps: deque[int] = deque()  # submitted steps whose replies are not read yet
        self._finished_steps: dict[int, Any] = {}  # ticket -> ModelRunnerOutput, read but not collected
        # async scheduling: steps go as _DEFERRED_STEP, and the ranks hold the last one's reply (its ticket)
        self._defers_steps = config.async_scheduling and self.max_concurrent_batches == 1 and _defers_outputs(
            platform_name)
        self._held_step: int | None = None
        rpc_timeout = os.environ.get("HALSERVE_MP_RPC_TIMEOUT_S")
        self.rpc_timeout_s = float(rpc_timeout) if rpc_timeout else None  # None: wait while ranks live
        ctx = multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        # Split the cores between the ranks unless the user chose a per-rank thread count.
        threads = os.environ.get("HALSERVE_CPU_THREADS") or str(max(1, _num_cores() // self.world_size))
        atexit.register(self.shutdown)
        try:
            for rank in range(self.world_size):
                env = {"HALSERVE_CPU_THREADS": threads, "LOCAL_RANK": str(rank)}
                parent_conn, child_conn = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker_main,
                    args=(child_conn, config, platform_name, model_info, rank, self.world_size, init_method, env),
                    name=f"halserve-worker-{rank}",
                    daemon=True,
                )
                proc.start()
                child_conn.close()
                self._conns.append(parent_conn)
                self._procs.append(proc)
                assert proc.pid is not None  # (set by start)
                self._pids.append(proc.pid)
        except BaseException:
            self.shutdown()
            raise
        logger.info("mp executor: %d worker processes (pids %s), %s threads each, %s",
                    self.world_size, [p.pid for p in self._procs], threads, init_method)

    # -- calls -----------------------------------------------------------------------
    @property
    def worker_pids(self) -> list[int]:
        """The worker processes' ids, by rank (still known after shutdown)."""
        return list(self._pids)

    def collective_rpc(self, method: str | Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``Worker.<method>(*args, **kwargs)`` on every rank, results by rank. ``method`` may
        also be a picklable module-level function, called as ``method(worker, *args, **kwargs)``.
        A rank's exception is re-raised here (its traceback as the cause)."""
        while self._pending_steps:  # (the replies of steps still in flight come first down the pipes)
            self._read_oldest_step()
        self._send_all(method, args, kwargs, full_reply_rank=None)
        return self._gather(method)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect_model(self.submit_model(scheduler_output))

    # -- overlapped steps: one in flight per pipeline stage ------------------------------
    @property
    def max_concurrent_batches(self) -> int:
        return self.config.pipeline_parallel_size

    def submit_model(self, scheduler_output: SchedulerOutput) -> int:
        """Send the step to every rank (each runs its calls in order); a ticket for ``collect_model``. With
        async scheduling the ranks answer the step before now and this one later (``_DEFERRED_STEP``)."""
        method = _DEFERRED_STEP if self._defers_steps else "execute_model"
        self._send_all(method, (scheduler_output,), {}, full_reply_rank=self.output_rank)
        ticket = next(self._tickets)
        self._pending_steps.append(ticket)
        if self._defers_steps:
            self._held_step = ticket  # (and the one held before is answered by this call)
        return ticket

    def collect_model(self, ticket: int) -> ModelRunnerOutput:
        while ticket not in self._finished_steps:
            self._read_oldest_step()
        return self._finished_steps.pop(ticket)

    def _read_oldest_step(self) -> None:
        if self._pending_steps[0] == self._held_step:  # no step came after it: ask for its reply
            self._send_all(_TAKE_DEFERRED, (), {}, full_reply_rank=self.output_rank)
            self._held_step = None
        results = self._gather("execute_model")
        ticket = self._pending_steps.popleft()
        try:
            self._finished_steps[ticket] = self.pick_output(results)
        except RuntimeError as exc:
            self._failure = str(exc)
            raise

    def check_health(self) -> None:
        self._raise_if_failed()
        for rank in range(self.world_size):
            if self._has_exited(rank):
                self._fail(rank, "is not running")

    # -- plumbing --------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._is_shut_down:
            raise WorkerDiedError(f"the {self.name!r} executor was shut down")
        if self._failure is not None:
            raise WorkerDiedError(f"the {self.name!r} executor is unusable: {self._failure}")

    def _has_exited(self, rank: int) -> bool:
        # The sentinel, not is_alive(): it also works when someone else reaped the process.
        from multiprocessing.connection import wait

        return bool(wait([self._procs[rank].sentinel], timeout=0))

    def _fail(self, rank: int, what: str) -> NoReturn:
        proc = self._procs[rank]
        code = proc.exitcode
        pid = self._pids[rank]
        if code is None:
            detail = "exit status unknown"
        elif code >= 0:
            detail = f"exit code {code}"
        else:
            detail = f"killed by signal {-code}"
        self._failure = (f"worker rank {rank} (pid {pid}) {what} ({detail}); "
                         "restart the engine")
        raise WorkerDiedError(self._failure)

    def _send_all(self, method, args: tuple, kwargs: dict, full_reply_rank: int | None) -> None:
        """Send the call to every rank; with ``full_reply_rank`` set (``execute_model``), the other
        ranks answer with only their sampled token ids."""
        self._raise_if_failed()
        for rank, conn in enumerate(self._conns):
            tokens_only = full_reply_rank is not None and rank != full_reply_rank
            try:
                conn.send((method, args, kwargs, tokens_only))
            except (BrokenPipeError, EOFError, OSError):
                self._procs[rank].join(0.5)
                self._fail(rank, f"could not be sent {method!r}")

    def _gather(self, method) -> list[Any]:
        """Each rank's reply to ``method``, in rank order; raises the first rank's error."""
        method = getattr(method, "__name__", method)
        replies: dict[int, tuple] = {}
        try:
            self._collect_replies(method, replies)
        except BaseException:
            # A dead rank, a timeout, Ctrl-C: replies may still come down the pipes, and the
            # next call would take them for its own. So there is no next call.
            if self._failure is None and len(replies) < self.world_size:
                self._failure = f"{method!r} was interrupted before every rank answered"
            raise
        errors = [(r, rep) for r, rep in sorted(replies.items()) if rep[0] == "error"]
        if errors:
            rank, (_, payload, summary, tb) = errors[0]
            if len(replies) < self.world_size or method == "execute_model":
                # other ranks are stuck in (or went past) a collective the failed one left
                self._failure = f"worker rank {rank} failed in {method!r}: {summary}"
            exc = pickle.loads(payload) if payload is not None else RuntimeError(
                f"worker rank {rank} failed in {method!r}: {summary}")
            if sys.version_info >= (3, 11):  # (no exception notes on 3.10)
                exc.add_note(f"(raised in {method!r} by worker rank {rank} of the mp executor)")
            raise exc from RemoteTraceback(f"\n(worker rank {rank})\n{tb}")
        return [replies[r][1] for r in range(self.world_size)]

    def _collect_replies(self, method: str, replies: dict[int, tuple]) -> None:
        """Fill ``replies`` (rank -> reply) until every rank answered, waiting on the pipes
        and the processes' sentinels together. Once one rank answered with an error the
        others get ``_ERROR_GRACE_S``; a rank that exits raises ``WorkerDiedError``."""
        from multiprocessing.connection import wait

        start = time.monotonic()
        first_error_at: float | None = None
        while len(replies) < self.world_size:
            pending = [r for r in range(self.world_size) if r not in replies]
            deadline = None if self.rpc_timeout_s is None else start + self.rpc_timeout_s
            if first_error_at is not None:
                grace_end = first_error_at + _ERROR_GRACE_S
                deadline = grace_end if deadline is None else min(deadline, grace_end)
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            handles = {self._conns[r]: r for r in pending}
            handles.update({self._procs[r].sentinel: r for r in pending})
            ready = wait(list(handles), timeout=timeout)
            if not ready:
                if first_error_at is not None:
                    break  # the others are stuck behind the failed rank
                self._failure = (f"{method!r} got no answer from ranks {pending} within "
                                 f"{self.rpc_timeout_s}s (HALSERVE_MP_RPC_TIMEOUT_S)")
                raise WorkerDiedError(self._failure)
            for rank in sorted({handles[h] for h in ready}):
                try:
                    reply = self._conns[rank].recv() if self._conns[rank].poll() else None
                except (EOFError, OSError):
                    reply = None
                if reply is None:  # only the sentinel was ready: the process is gone
                    self._procs[rank].join(0.5)
                    self._fail(rank, f"died during {method!r}")
                replies[rank] = reply
                if reply[0] == "error" and first_error_at is None:
                    first_error_at = time.monotonic()
        for rank in range(self.world_size):
            if rank not in replies and self._has_exited(rank):
                self._fail(rank, f"died during {method!r}")  # the cause of the others' errors

    # -- lifecycle -------------------------------------------------------------------
    def shutdown(self) -> None:
        """Ask every worker to exit, then terminate (and kill) the ones that do not. Idempotent."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        atexit.unregister(self.shutdown)
        for rank, conn in enumerate(self._conns):
            if not self._has_exited(rank):
                try:
                    conn.send((_SHUTDOWN, (), {}, False))
                except (BrokenPipeError, EOFError, OSError):
                    pass
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for rank, proc in enumerate(self._procs):
            if not self._has_exited(rank):
                proc.terminate()
                proc.join(_JOIN_TIMEOUT_S)
            if not self._has_exited(rank):
                proc.kill()
                proc.join(_JOIN_TIMEOUT_S)
        for conn in self._conns:
            conn.close()
        for proc in self._procs:
            try:
                proc.close()
            except ValueError:  # reaped elsewhere, so multiprocessing cannot tell it ended
                pass

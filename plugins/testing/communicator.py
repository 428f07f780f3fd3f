"""Kit check ``communicator`` (plugin API 2): a platform's device communicator against gloo, two ranks.

For every platform the plugin registers (and that is available here), two processes are spawned;
each joins a process group (gloo for a CPU-device platform, else the platform's ``dist_backend``
with a gloo group beside it for the references), builds ``Platform.make_device_communicator(None,
rank, 2)`` and runs each op on the platform's device, and the same op through gloo on host copies
of the same inputs::

    all_reduce     sum of both ranks' [5, 8]
    all_gather     along dim 0 and dim -1
    all_to_all     [6, 4]: rows 0-2 to rank 0, rows 3-5 to rank 1
    broadcast      rank 1's tensor on both
    send/recv      rank 0 -> rank 1, then rank 1 -> rank 0
    all_reduce     in each half-precision dtype the platform supports, against the exact sum

The communicator must first keep the contract (``check_communicator``: a ``DeviceCommunicator``
subclass whose ops take the base class's arguments), else one ``contract`` row fails. Results must
equal gloo's within 1e-5 of max |gloo| (a sum may be ordered differently). The
platform's API 1 fast path (``make_tp_communicator``), when it returns one, is checked the same way
for all_reduce and all_gather. A rank that raises or hangs (60 s) fails the op it was in.
"""
from __future__ import annotations

import multiprocessing
import queue as queue_module
import socket
import traceback
from typing import Any

from halserve.plugins.testing.results import ConformanceReport, Status
from halserve.plugins.testing.target import TargetResolver

TOLERANCE = 1e-5  # relative to max |gloo's result|
HALF_TOLERANCE = {"float16": 1e-3, "bfloat16": 8e-3}  # one rounding of the exact sum (relative)
TIMEOUT_S = 60.0  # per rank, for everything (process start included)
CASES = ("all_reduce", "all_gather", "all_to_all", "broadcast", "send/recv")
WORLD = 2


def check_communicators(report: ConformanceReport, manager: Any, resolver: TargetResolver) -> None:
    for reg in manager.platforms.by_plugin(report.plugin):
        subject = f"{reg.name} communicator"
        available, reason = resolver.probe(reg.name)
        if not available:
            report.add("communicator", subject, "vs gloo (2 ranks)", "declined", f"platform {reg.name} unavailable here ({reason})")
            continue
        cls = reg.obj
        target = f"{cls.__module__}:{cls.__qualname__}"
        for case, status, detail in run_two_ranks(target):
            report.add("communicator", subject, case, status, detail)


def run_two_ranks(target: str, timeout_s: float = TIMEOUT_S) -> list[tuple[str, Status, str]]:
    """(case, status, detail) rows of the two-rank check of platform class ``target`` ("module:Class")."""
    ctx = multiprocessing.get_context("spawn")  # (a fresh interpreter: no torch threads or process group inherited)
    results: Any = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, port, target, results), daemon=True) for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    per_rank: dict[int, list[tuple[str, str, str]]] = {}
    try:
        while len(per_rank) < WORLD:
            try:
                rank, rank_rows = results.get(timeout=timeout_s)
            except queue_module.Empty:
                missing = sorted(set(range(WORLD)) - set(per_rank))
                return [("run", "failed", f"rank(s) {missing} did not finish within {timeout_s:.0f} s (a hung collective?)")]
            per_rank[rank] = rank_rows
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    merged: dict[str, list[tuple[str, str]]] = {}
    for rank in range(WORLD):
        for case, status, detail in per_rank[rank]:
            merged.setdefault(case, []).append((status, f"rank {rank}: {detail}"))
    rows: list[tuple[str, Status, str]] = []
    for case, outcomes in merged.items():
        failed = [detail for status, detail in outcomes if status == "failed"]
        if failed:
            rows.append((case, "failed", "; ".join(failed)))
        elif all(status == "declined" for status, _ in outcomes):
            rows.append((case, "declined", outcomes[0][1]))
        else:
            rows.append((case, "passed", "; ".join(detail for _, detail in outcomes)))
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, port: int, target: str, results: Any) -> None:
    rows: list[tuple[str, str, str]] = []
    try:
        _run_rank(rank, port, target, rows)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent as a row
        rows.append(("setup", "failed", f"{type(exc).__name__}: {exc} ({_where(exc)})"))
    results.put((rank, rows))
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def _run_rank(rank: int, port: int, target: str, rows: list[tuple[str, str, str]]) -> None:
    import datetime
    import importlib

    import torch
    import torch.distributed as dist

    module, _, qualname = target.partition(":")
    cls: Any = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    platform = cls()
    if platform.device_type != "cpu" and platform.device_count() < WORLD:
        rows.extend((case, "declined", f"{platform.device_count()} {platform.name} device(s); the check needs "
                     f"{WORLD}") for case in CASES)
        return
    if platform.device_count() > 1:
        platform.set_device(rank)
    backend = "gloo" if platform.device_type == "cpu" else platform.dist_backend
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    gloo = None if backend == "gloo" else dist.new_group(backend="gloo")
    device = platform.device(rank if platform.device_count() > 1 else 0)
    from halserve.distributed.communicator import check_communicator

    try:
        comm = check_communicator(platform.make_device_communicator(None, rank, WORLD), platform.name)
    except TypeError as exc:
        rows.append(("contract", "failed", str(exc)))
        return
    _check_ops(comm, gloo, device, rank, rows, prefix="")
    for dtype_name in platform.supported_dtypes:  # half-precision sums (a device may accumulate wider)
        if dtype_name in ("float16", "bfloat16"):
            _check_half_all_reduce(comm, gloo, device, rank, rows, getattr(torch, dtype_name))
    fast = platform.make_tp_communicator(None, rank, WORLD)
    if fast is not None:
        _check_ops(fast, gloo, device, rank, rows, prefix="make_tp_communicator ", only=("all_reduce", "all_gather"))


def _check_half_all_reduce(comm: Any, gloo: Any, device: Any, rank: int, rows: list, dtype: Any) -> None:
    import torch
    import torch.distributed as dist

    case = f"all_reduce {str(dtype).replace('torch.', '')}"
    try:
        x = _inputs(case, rank, (5, 8)).to(dtype)
        want = x.float()
        dist.all_reduce(want, group=gloo)  # the exact sum of the two half-precision inputs
        got = comm.all_reduce(x.clone().to(device)).to("cpu", torch.float32)
        err = float((got - want).abs().max()) / (float(want.abs().max()) or 1.0)
        tolerance = HALF_TOLERANCE[str(dtype).replace('torch.', '')]
        rows.append((case, "passed" if err <= tolerance else "failed",
                     f"max error {err:.1e} of max |exact sum| (tolerance {tolerance:.0e}: one rounding)"))
    except Exception as exc:  # noqa: BLE001
        rows.append((case, "failed", f"{type(exc).__name__}: {exc} ({_where(exc)})"))


def _inputs(case: str, rank: int, shape: tuple[int, ...]) -> Any:
    import torch

    gen = torch.Generator().manual_seed(sum(map(ord, case)) * 16 + rank)  # (stable across processes)
    return torch.randn(shape, generator=gen)


def _check_ops(comm: Any, gloo: Any, device: Any, rank: int, rows: list, prefix: str,
               only: tuple[str, ...] = CASES) -> None:
    import torch
    import torch.distributed as dist

    peer = 1 - rank

    def compare(case: str, got: Any, want: torch.Tensor) -> None:
        if not isinstance(got, torch.Tensor):
            rows.append((prefix + case, "failed", f"returned {type(got).__name__}, not a tensor"))
            return
        got = got.detach().to("cpu", torch.float32)
        if tuple(got.shape) != tuple(want.shape):
            rows.append((prefix + case, "failed", f"shape {tuple(got.shape)}, gloo gives {tuple(want.shape)}"))
            return
        scale = float(want.abs().max()) or 1.0
        err = float((got - want).abs().max()) / scale
        status = "passed" if err <= TOLERANCE else "failed"
        rows.append((prefix + case, status, f"max error {err:.1e} of max |gloo| (tolerance {TOLERANCE:.0e})"))

    def run(case: str, fn: Any) -> None:
        if case.split("#")[0].strip() not in only:
            return
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            rows.append((prefix + case, "failed", f"{type(exc).__name__}: {exc} ({_where(exc)})"))

    def all_reduce() -> None:
        x = _inputs("all_reduce", rank, (5, 8))
        want = x.clone()
        dist.all_reduce(want, group=gloo)
        compare("all_reduce", comm.all_reduce(x.clone().to(device)), want)

    def all_gather() -> None:
        x = _inputs("all_gather", rank, (3, 4))
        parts = [torch.empty_like(x) for _ in range(WORLD)]
        dist.all_gather(parts, x, group=gloo)
        for dim in (0, -1):
            compare(f"all_gather dim={dim}", comm.all_gather(x.clone().to(device), dim), torch.cat(parts, dim=dim))

    def all_to_all() -> None:
        x = _inputs("all_to_all", rank, (3 * WORLD, 4))
        want = torch.empty_like(x)
        dist.all_to_all_single(want, x, group=gloo)
        compare("all_to_all", comm.all_to_all(x.clone().to(device)), want)

    def broadcast() -> None:
        x = _inputs("broadcast", rank, (4, 6))
        want = x.clone()
        dist.broadcast(want, src=1, group=gloo)
        compare("broadcast", comm.broadcast(x.clone().to(device), 1), want)

    def send_recv() -> None:
        mine = _inputs("send/recv", rank, (2, 5))
        theirs = [torch.empty_like(mine) for _ in range(WORLD)]
        dist.all_gather(theirs, mine, group=gloo)  # what the peer sends, as gloo delivers it
        box = torch.empty_like(mine).to(device)
        if rank == 0:
            comm.send(mine.to(device), 1)
            got = comm.recv(box, 1)
        else:
            got = comm.recv(box, 0)
            comm.send(mine.to(device), 0)
        compare("send/recv", box if got is None else got, theirs[peer])

    for case, fn in (("all_reduce", all_reduce), ("all_gather", all_gather), ("all_to_all", all_to_all),
                     ("broadcast", broadcast), ("send/recv", send_recv)):
        run(case, fn)

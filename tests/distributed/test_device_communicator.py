"""``DeviceCommunicator`` (the torch.distributed default of ``Platform.make_device_communicator``) on two
real gloo ranks: every op's result against values computed from both ranks' inputs, group-local ranks,
the pipeline stages' send/recv going through the communicator set with ``set_pp_communicator``, and the
tensor-parallel helpers as no-ops on one rank."""
from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from halserve import distributed
from halserve.distributed.communicator import DeviceCommunicator, check_communicator


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(7 + rank))


class CountingCommunicator(DeviceCommunicator):
    sends = recvs = 0

    def send(self, x, dst):
        type(self).sends += 1
        super().send(x, dst)

    def recv(self, x, src):
        type(self).recvs += 1
        return super().recv(x, src)


def _rank_main(rank: int, port: int, out: dict) -> None:
    torch.set_num_threads(1)
    # two ranks, tensor_parallel_size 1: two pipeline stages (rank 0 sends to rank 1)
    distributed.init_distributed("gloo", f"tcp://127.0.0.1:{port}", rank, 2, timeout_s=60, tensor_parallel_size=1)
    try:
        comm = DeviceCommunicator(None, rank, 2)
        a, b = _inputs(0, (4, 6)), _inputs(1, (4, 6))
        mine = (a, b)[rank]
        res = {}
        res["all_reduce"] = torch.equal(comm.all_reduce(mine.clone()), a + b)
        res["all_gather0"] = torch.equal(comm.all_gather(mine, 0), torch.cat([a, b], 0))
        res["all_gather1"] = torch.equal(comm.all_gather(mine, -1), torch.cat([a, b], -1))
        # rows 0-1 go to rank 0, rows 2-3 to rank 1; each receives [from rank 0; from rank 1]
        res["all_to_all"] = torch.equal(comm.all_to_all(mine), torch.cat([a[2 * rank:2 * rank + 2], b[2 * rank:2 * rank + 2]]))
        res["broadcast"] = torch.equal(comm.broadcast(mine.clone(), src=1), b)
        box = torch.empty_like(mine)
        if rank == 0:
            comm.send(mine, dst=1)
            comm.recv(box, src=1)
        else:
            comm.recv(box, src=0)
            comm.send(mine, dst=0)
        res["send/recv"] = torch.equal(box, (a, b)[1 - rank])
        with pytest.raises(ValueError, match="not divisible by the 2 ranks"):
            comm.all_to_all(torch.zeros(3, 2))
        with pytest.raises(ValueError, match="rank 2 is not in this communicator's group of 2 ranks"):
            comm.send(mine, dst=2)

        # pipeline parallelism sends the stage's tensors through the communicator, in key order
        distributed.set_pp_communicator(CountingCommunicator(None, rank, 2))
        stage = {"hidden_states": a * 3, "residual": b * 5}
        if distributed.get_pp_state().is_first:
            distributed.pp_send(stage)
            res["pp"] = True
        else:
            got = distributed.pp_recv({k: torch.empty_like(v) for k, v in stage.items()})
            res["pp"] = all(torch.equal(got[k], stage[k]) for k in stage)
        res["pp_counts"] = (CountingCommunicator.sends, CountingCommunicator.recvs)
        # one tensor-parallel rank per stage: the helpers are no-ops
        res["tp_noop"] = distributed.tensor_model_parallel_all_to_all(mine) is mine and \
            distributed.tensor_model_parallel_broadcast(mine, 0) is mine
        out[rank] = res
    finally:
        distributed.destroy_distributed()


def test_device_communicator_ops_and_pipeline_send_recv_on_two_gloo_ranks() -> None:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank_main, args=(_free_port(), out), nprocs=2, join=True)
        results = dict(out)
    for rank in (0, 1):
        res = results[rank]
        for op in ("all_reduce", "all_gather0", "all_gather1", "all_to_all", "broadcast", "send/recv", "pp", "tp_noop"):
            assert res[op] is True, (rank, op, res)
    assert results[0]["pp_counts"] == (2, 0) and results[1]["pp_counts"] == (0, 2)


def test_set_tp_communicator_keeps_the_api_1_fast_path_beside_the_device_communicator() -> None:
    class Fast:  # (plugin API 1: supports / all_reduce / all_gather)
        def supports(self, x):
            return x.dtype == torch.float32

        def all_reduce(self, x):
            return x

        def all_gather(self, x, dim=-1):
            return x

    saved = distributed.get_tp_state()
    try:
        fast, comm = Fast(), DeviceCommunicator(None, 0, 1)
        distributed.set_tp_communicator(fast)
        distributed.set_tp_communicator(comm)
        state = distributed.get_tp_state()
        assert state.comm is fast and state.device_comm is comm
        assert distributed.get_tp_communicator() is comm
        distributed.set_tp_communicator(None)  # (a platform without a fast path: the device communicator stays)
        assert distributed.get_tp_state().comm is None and distributed.get_tp_state().device_comm is comm
        distributed.destroy_tensor_parallel()
        assert type(distributed.get_tp_communicator()) is DeviceCommunicator  # the default
        with pytest.raises(TypeError, match="takes a DeviceCommunicator, got Fast"):
            distributed.set_pp_communicator(fast)  # type: ignore[arg-type]
    finally:
        distributed.destroy_tensor_parallel()
        assert distributed.get_tp_state() == saved


def test_bad_ranks_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match=r"DeviceCommunicator\(rank=2, size=2\): need 0 <= rank < size"):
        DeviceCommunicator(None, 2, 2)


class RenamedArgCommunicator(DeviceCommunicator):
    def all_gather(self, x, axis=-1):  # halserve calls all_gather(x, dim)
        return super().all_gather(x, axis)


class FineCommunicator(DeviceCommunicator):
    def send(self, x, dst):
        super().send(x, dst)


@pytest.mark.parametrize(
    ("comm", "expected"),
    [
        (RenamedArgCommunicator(None, 0, 1),
         "platform 'acme': communicator RenamedArgCommunicator.all_gather(self, x, axis) does not match "
         "DeviceCommunicator.all_gather(self, x, dim); keep the base class's arguments"),
        (object(), "platform 'acme': make_device_communicator returned <object object at"),
    ],
    ids=["renamed-argument", "not-a-DeviceCommunicator"],
)
def test_a_communicator_breaking_the_contract_is_refused_naming_the_op(comm, expected: str) -> None:
    with pytest.raises(TypeError) as info:
        check_communicator(comm, "acme")
    assert expected in str(info.value)


def test_a_communicator_keeping_the_contract_passes_the_check() -> None:
    comm = FineCommunicator(None, 0, 1)
    assert check_communicator(comm, "acme") is comm

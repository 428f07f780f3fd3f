"""Two real tensor-parallel ranks (gloo, one process each) give the same logits as one
rank: sharded QKV with biases, gate/up, row-parallel reductions, a vocab that does not
divide by the rank count."""
from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp
from model_factory import make_checkpoint

PROMPTS = [[1, 45, 74, 299, 17, 273], [1, 300, 2, 9], [1, 100]]


def run_model(path: str, block_size: int = 4) -> torch.Tensor:
    """Prefill PROMPTS in one step, then one decode step; logits of both steps."""
    from paged_harness import PagedHarness

    from halserve.attention_backends.torch_ref import TorchAttentionBackend
    from halserve.config import EngineConfig
    from halserve.models.loader import get_model_info, load_model
    from halserve.platforms.cpu import CpuPlatform

    config = EngineConfig(model=path, dtype="float32")
    platform = CpuPlatform()
    info = get_model_info(config, platform)
    model = load_model(config, info, platform, TorchAttentionBackend, progress=False)
    harness = PagedHarness(model, TorchAttentionBackend, block_size=block_size)
    prefill = harness.step([(f"r{i}", p) for i, p in enumerate(PROMPTS)])
    decode = harness.step([(f"r{i}", [7]) for i in range(len(PROMPTS))])
    return torch.cat([prefill, decode])


def _rank_main(rank: int, world_size: int, port: int, path: str, out_file: str) -> None:
    import os

    os.environ["HALSERVE_CPU_THREADS"] = "1"
    from halserve.distributed import destroy_distributed, init_distributed

    init_distributed("gloo", f"tcp://127.0.0.1:{port}", rank, world_size)
    try:
        logits = run_model(path)
        if rank == 0:
            torch.save(logits, out_file)
    finally:
        destroy_distributed()


def assert_two_ranks_match_one(path: str, tmp_path, vocab_size: int) -> None:
    """The checkpoint at ``path`` run by two gloo ranks (two spawned processes) gives the logits of one rank."""
    want = run_model(path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_file = str(tmp_path / "tp2.pt")
    mp.start_processes(_rank_main, args=(2, port, path, out_file), nprocs=2, join=True, start_method="spawn")
    got = torch.load(out_file)
    assert got.shape == want.shape == (sum(map(len, PROMPTS)) + len(PROMPTS), vocab_size)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # two spawned processes: ~15 s of CPU
def test_two_ranks_match_one(tmp_path):
    path = make_checkpoint(tmp_path / "ckpt", "qwen2", vocab_size=301, num_heads=4, num_kv_heads=2)
    assert_two_ranks_match_one(path, tmp_path, 301)


def test_rank_counts_that_do_not_split_the_model_are_refused_before_any_rank_starts(tmp_path):
    from halserve.config import EngineConfig
    from halserve.models.loader import get_model_info
    from halserve.platforms.cpu import CpuPlatform

    path = make_checkpoint(str(tmp_path), "llama")  # 4 heads, 2 KV heads, intermediate size 128
    for tp in (3, 8):
        with pytest.raises(ValueError, match=f"tensor_parallel_size {tp} does not divide .* sizes that fit: 1, 2, 4$"):
            get_model_info(EngineConfig(model=path, tensor_parallel_size=tp), CpuPlatform())
    info = get_model_info(EngineConfig(model=path, tensor_parallel_size=4), CpuPlatform())  # a KV head per 2 ranks
    assert info.num_kv_heads == 2

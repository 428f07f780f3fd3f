"""KV connectors on a GPU (cuda platform, triton_paged backend): blocks saved from and loaded into
device caches (host pool in pinned memory, safetensors files) give the tokens a plain engine gives.
Runs with the GPU checks (benchmarks/gpu/run_gpu_checks.sh runs this directory compiled)."""
from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from model_factory import make_checkpoint

    path = make_checkpoint(str(tmp_path_factory.mktemp("kv_gpu")), "llama", hidden_size=128, num_heads=4,
                           num_kv_heads=2, head_dim=64)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(70)] for _ in range(3)]
    return path, prompts


def _run(path, prompts, rounds=1, **kwargs):
    from halserve import LLM, SamplingParams

    llm = LLM(path, platform="cuda", dtype="float32", attention_backend="triton_paged", **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        runs = [llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                for _ in range(rounds)]
        return runs, llm.llm_engine.get_stats()
    finally:
        llm.llm_engine.shutdown()


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_offloading_on_cuda(setup):
    import torch

    if torch.version.hip:
        pytest.skip("the cuda platform")
    path, prompts = setup
    (plain,), _ = _run(path, prompts, num_kv_blocks=64)
    cfg = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"num_cpu_blocks": 40}}
    (first, second), stats = _run(path, prompts, rounds=2, num_kv_blocks=7, max_num_seqs=1, kv_transfer_config=cfg)
    assert _tokens(first) == _tokens(second) == _tokens(plain)
    assert stats.kv_connector_hit_tokens == 192


def test_shared_storage_on_cuda(setup, tmp_path):
    import torch

    if torch.version.hip:
        pytest.skip("the cuda platform")
    path, prompts = setup
    (plain,), _ = _run(path, prompts, num_kv_blocks=64)
    cfg = {"kv_connector": "SharedStorageConnector",
           "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    _run(path, prompts, num_kv_blocks=64, kv_transfer_config=cfg)
    (loaded,), stats = _run(path, prompts, num_kv_blocks=64, kv_transfer_config=cfg)
    assert _tokens(loaded) == _tokens(plain) and stats.kv_connector_hit_tokens == 192

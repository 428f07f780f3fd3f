"""Without a GPU: the triton_paged backend reading its metadata from the runner's static graph
buffers (worker/step_graphs.py), through the Triton interpreter. The cuda platform is moved to the
CPU as in test_triton_engine_interpreted.py and given the reference EagerReplayCapture, whose
replay re-runs the forward on those buffers: padded decode batches (3 -> 4) must give the tokens
of the eager engine, token for token. On a GPU, test_triton_engine_gpu.py replays real CUDA graphs.
"""
from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="a GPU is present: test_triton_engine_gpu.py replays real CUDA graphs instead"
)
pytestmark = [pytestmark, pytest.mark.slow, pytest.mark.extended]  # an engine through the Triton interpreter (inner loop: -m 'not slow')


@pytest.fixture
def interpreted_cuda_with_replay(monkeypatch):
    from halserve.platforms.base import ProbeResult
    from halserve.platforms.cuda import CudaPlatform
    from halserve.platforms.graph_capture import EagerReplayCapture

    monkeypatch.setattr(CudaPlatform, "_probe", classmethod(lambda cls: ProbeResult(True, "interpreted on CPU")))
    monkeypatch.setattr(CudaPlatform, "device_type", "cpu")
    monkeypatch.setattr(CudaPlatform, "memory_info", lambda self, index=0: (1 << 30, 2 << 30))
    for name in ("set_device", "synchronize", "empty_cache"):
        monkeypatch.setattr(CudaPlatform, name, lambda self, *args: None)
    monkeypatch.setattr(CudaPlatform, "seed_everything", lambda self, seed: torch.manual_seed(seed))
    monkeypatch.setattr(CudaPlatform, "capability", lambda self, index=0: (9, 0))
    capture = EagerReplayCapture()
    monkeypatch.setattr(CudaPlatform, "graph_capture", lambda self: capture)
    return capture


def test_triton_paged_replays_from_static_buffers(interpreted_cuda_with_replay, tmp_path):
    from model_factory import make_checkpoint

    from halserve import LLM, SamplingParams

    path = make_checkpoint(str(tmp_path), "llama", hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 20, 37)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 6, 8)]
    tokens = {}
    for eager in (False, True):
        llm = LLM(path, platform="cuda", dtype="float32", block_size=16, max_num_batched_tokens=64, max_num_seqs=4,
                  num_kv_blocks=24, attention_backend="triton_paged", enforce_eager=eager)
        graphs = llm.llm_engine.core.executor.worker.model_runner.step_graphs
        assert (graphs is None) == eager and (eager or graphs.sizes == [1, 2, 4])
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[eager] = [o.outputs[0].token_ids for o in outputs]
    assert interpreted_cuda_with_replay.num_replays >= 4
    assert tokens[False] == tokens[True]

"""worker/async_output.py and the model runner's deferred steps (async scheduling), on the CPU: a
step's sampled ids stay in their (device) tensor, the next step's placeholder inputs are gathered
from it by request id, and the step's output is read back after the next step is launched."""
from __future__ import annotations

import os
import random

import pytest
import torch

from halserve import LLM, SamplingParams
from halserve.worker.async_output import StepTokens

# (benchmarks/gpu/run_gpu_checks.sh async runs these on cuda)
BASE = dict(platform=os.environ.get("HALSERVE_ASYNC_TEST_PLATFORM", "cpu"), dtype="float32", block_size=16, max_num_batched_tokens=64, max_model_len=256)


def test_step_tokens_gather_by_request_id():
    tokens = StepTokens({"a": 0, "b": 1, "c": 2}, torch.tensor([10, 20, 30]))
    assert tokens.gather(["c", "a"]).tolist() == [30, 10]
    assert tokens.gather([]).tolist() == []
    with pytest.raises(AssertionError, match=r"\['d'\] have a placeholder input but sampled nothing"):
        tokens.gather(["a", "d"])


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    from model_factory import make_checkpoint

    return make_checkpoint(str(tmp_path_factory.mktemp("ckpt")), "llama")


def _generate(path, prompts, params, **kwargs):
    llm = LLM(path, **{**BASE, **kwargs})
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        num_on_device, = llm.llm_engine.core.collective_rpc("num_placeholder_inputs")
    finally:
        llm.llm_engine.shutdown()
    return [o.outputs[0].token_ids for o in outputs], num_on_device


@pytest.mark.slow
def test_placeholders_come_from_their_own_requests_row(llama_path, monkeypatch):
    """Requests join (first in the batch), finish and wait for seats, so a request's row in the step
    before differs from its row now: async scheduling (the in-process ``uni`` executor, deferred steps)
    gives the synchronous tokens only if each placeholder reads its own request's id. The control
    run reads them by batch position instead (the bug) and must differ."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (9, 30, 4, 17, 12, 25, 6)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (14, 5, 9, 12, 3, 10, 7)]
    kwargs = dict(max_num_seqs=3)
    want, none = _generate(llama_path, prompts, params, **kwargs)
    got, num_on_device = _generate(llama_path, prompts, params, async_scheduling=True,
                                   distributed_executor_backend="uni", **kwargs)
    assert none == 0 and num_on_device >= sum(p.max_tokens - 1 for p in params) // 2
    assert got == want

    def by_position(self, req_ids):  # the bug: the step before's row taken to be the row now
        rows = torch.arange(len(req_ids)).clamp(max=len(self.sampled) - 1)
        return self.sampled.index_select(0, rows)

    monkeypatch.setattr(StepTokens, "gather", by_position)
    wrong, _ = _generate(llama_path, prompts, params, async_scheduling=True, distributed_executor_backend="uni",
                         **kwargs)
    assert wrong != want, "the batch order never changed between steps: this test checks nothing"

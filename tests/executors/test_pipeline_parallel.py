"""Pipeline parallelism end to end: real worker processes (the ``mp`` executor), real
torch.distributed (gloo) point-to-point sends of the hidden states between stages, against
one rank and transformers. Engines are shared per module (starting ranks is the slow part)."""
from __future__ import annotations

import os
import random
import time

import pytest
from engine_helpers import generate_ids, greedy_params, hf_greedy

pytestmark = pytest.mark.slow  # engines with a process per pipeline stage (inner loop: -m 'not slow')

NEW_TOKENS = 12
PROMPT_LENGTHS = [1, 7, 16, 37, 70, 5, 23, 48]  # 70 > the step budget: chunked prefill
# 12 blocks of 16 hold 192 tokens, less than the 8 requests need together: some are preempted and
# recomputed (measured on one rank: 2 preemptions), and a second run still finds prompt blocks cached
ENGINE_KWARGS = dict(platform="cpu", dtype="float32", block_size=16, max_num_batched_tokens=64,
                     num_kv_blocks=12, max_num_seqs=8)


def _greedy(max_tokens: int = NEW_TOKENS):
    return greedy_params(max_tokens)


def _generate(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """3 layers over 2 stages (2 + 1); tied embeddings: the last stage keeps the embedding for its head."""
    from model_factory import make_checkpoint

    path = make_checkpoint(str(tmp_path_factory.mktemp("llama_pp")), "llama", num_layers=3, num_heads=4,
                           num_kv_heads=2, tie_word_embeddings=True, attention_bias=True)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENGTHS]
    return path, prompts


@pytest.fixture(scope="module")
def one_rank(llama):
    from halserve import LLM

    path, _ = llama
    llm = LLM(path, **ENGINE_KWARGS)
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def pp2(llama):
    from halserve import LLM

    path, _ = llama
    llm = LLM(path, pipeline_parallel_size=2, **ENGINE_KWARGS)
    yield llm
    llm.llm_engine.shutdown()


def test_two_stages_greedy_match_one_rank_and_transformers(llama, one_rank, pp2):
    from halserve.executors.mp import MultiprocExecutor

    path, prompts = llama
    executor = pp2.llm_engine.core.executor
    assert isinstance(executor, MultiprocExecutor) and len(executor.worker_pids) == 2
    assert executor.output_rank == 1
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    assert generate_ids(one_rank, prompts, _greedy()) == expected
    before = pp2.llm_engine.core.get_stats()
    assert generate_ids(pp2, prompts, _greedy()) == expected
    stats = pp2.llm_engine.core.get_stats()
    assert stats.num_preemptions > before.num_preemptions  # (the cache is too small for all at once)
    # again: now the prompts' blocks are in the prefix cache of both stages
    assert generate_ids(pp2, prompts, _greedy()) == expected
    assert pp2.llm_engine.core.get_stats().prefix_cache_hits > stats.prefix_cache_hits


def test_the_two_stages_work_on_two_batches_at_once(llama, one_rank, pp2, monkeypatch):
    """A second batch (of other requests) is submitted while the first is in flight."""
    core = pp2.llm_engine.core
    assert core.max_concurrent_batches == 2
    in_flight_at_submit = []
    submit = core.executor.submit_model

    def recording_submit(scheduler_output):
        in_flight_at_submit.append(len(core._batches))
        return submit(scheduler_output)

    monkeypatch.setattr(core.executor, "submit_model", recording_submit)
    _, prompts = llama
    assert generate_ids(pp2, prompts, _greedy()) == generate_ids(one_rank, prompts, _greedy())
    assert in_flight_at_submit.count(1) > len(in_flight_at_submit) // 2


def _stage_layout(worker) -> tuple[int, int, int]:
    """Run in a worker: (stage, attention layers, KV-cache tensors)."""
    runner = worker.model_runner
    return runner.pp.rank, len(runner.model.attention_layers), len(runner.kv_caches)


def test_each_stage_holds_its_layers_kv_cache(pp2):
    assert pp2.llm_engine.core.executor.collective_rpc(_stage_layout) == [(0, 2, 2), (1, 1, 1)]


def test_sampling_logprobs_and_prompt_logprobs_match_one_rank(llama, one_rank, pp2):
    """Only the last stage samples: seeded sampling, n > 1, penalties and logprobs are those of one rank."""
    from halserve import SamplingParams

    _, prompts = llama
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, n=2, max_tokens=8, logprobs=3, prompt_logprobs=2,
                            repetition_penalty=1.2, ignore_eos=True)
    want, got = _generate(one_rank, prompts[:4], params), _generate(pp2, prompts[:4], params)
    for w, g in zip(want, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        assert [e.keys() if e else None for e in g.prompt_logprobs] == \
               [e.keys() if e else None for e in w.prompt_logprobs]
        for wc, gc in zip(w.outputs, g.outputs):
            assert wc.cumulative_logprob == pytest.approx(gc.cumulative_logprob, abs=1e-4)
            assert [sorted(e) for e in gc.logprobs] == [sorted(e) for e in wc.logprobs]


def test_speculation_through_two_stages(tmp_path):
    """ngram: the scheduler proposes, the last stage verifies, the first gets the accepted tokens.
    A draft model: whole, on the last stage only (it needs the sampled tokens), sharing its block tables."""
    from engine_helpers import assert_speculation_matches
    from model_factory import make_checkpoint

    path = make_checkpoint(str(tmp_path), "llama", num_layers=2, layer_scale=0.6)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9]]
    assert_speculation_matches(path, prompts, hf_greedy(path, prompts, 24), 24, pipeline_parallel_size=2,
                               **ENGINE_KWARGS)


def test_classifier_on_two_stages_matches_transformers(tmp_path):
    """A pooling model: the last stage pools and classifies."""
    import torch
    from classifier_factory import hf_logits, make_classifier

    from halserve import LLM

    path = make_classifier(tmp_path, "qwen2", num_labels=3)
    reference = hf_logits(path)
    prompts = [[1, 5, 9, 44, 3], list(range(3, 90))]
    llm = LLM(path, pipeline_parallel_size=2, **ENGINE_KWARGS)
    try:
        outs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    for ids, out in zip(prompts, outs):
        torch.testing.assert_close(torch.tensor(out.outputs.probs), reference(ids).softmax(-1), rtol=1e-4,
                                   atol=1e-5)


@pytest.mark.slow  # four worker processes on two cores
def test_two_stages_of_two_tensor_parallel_ranks(llama):
    from halserve import LLM

    path, prompts = llama
    llm = LLM(path, pipeline_parallel_size=2, tensor_parallel_size=2, **ENGINE_KWARGS)
    try:
        executor = llm.llm_engine.core.executor
        assert executor.output_rank == 2 and list(executor.sampling_ranks()) == [2, 3]
        assert generate_ids(llm, prompts, _greedy()) == hf_greedy(path, prompts, NEW_TOKENS)
    finally:
        llm.llm_engine.shutdown()


def test_what_pipeline_parallelism_cannot_run_is_refused_before_any_rank_starts(llama, monkeypatch):
    from halserve import LLM

    path, _ = llama
    with pytest.raises(ValueError, match="executor 'uni' runs a single rank"):
        LLM(path, pipeline_parallel_size=2, distributed_executor_backend="uni", **ENGINE_KWARGS)
    monkeypatch.setenv("HALSERVE_PP_LAYER_PARTITION", "1,1")
    with pytest.raises(ValueError, match="HALSERVE_PP_LAYER_PARTITION='1,1' must give 2 stage sizes >= 1 summing "
                                         "to the model's 3 layers"):
        LLM(path, pipeline_parallel_size=2, **ENGINE_KWARGS)


def test_a_dead_first_stage_is_reported_and_the_engine_shuts_down_cleanly(llama, pp2):
    """(Last in the module: it breaks the shared engine.)"""
    from halserve.executors.mp import WorkerDiedError

    _, prompts = llama
    executor = pp2.llm_engine.core.executor
    first_stage = executor.worker_pids[0]
    os.kill(first_stage, 9)
    with pytest.raises(WorkerDiedError, match="worker rank 0"):
        _generate(pp2, prompts[:2], _greedy())
    pp2.llm_engine.shutdown()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in executor.worker_pids):
        time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in executor.worker_pids)

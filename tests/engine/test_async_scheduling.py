"""Async scheduling (``async_scheduling=True``) gives the same tokens as synchronous scheduling:
chunked prefill, preemption (requests preempted while their step is in flight), prefix-cache
hits, n > 1, seeded sampling, penalties, min_tokens, max_tokens, stop token ids, stop strings and
structured outputs, on the ``mp`` executor (the worker's process) and ``uni`` (the engine's thread);
a decode step's input is the step before's sampled id, gathered on the device (the same code runs
on the CPU, whose "device" tensors are host tensors); features it cannot run yet warn at start-up
and run synchronously."""
from __future__ import annotations

import logging
import os
import random

import pytest

from halserve import LLM, SamplingParams

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')

BLOCK = 16
# (benchmarks/gpu/run_gpu_checks.sh async runs these on cuda)
BASE = dict(platform=os.environ.get("HALSERVE_ASYNC_TEST_PLATFORM", "cpu"), dtype="float32", block_size=BLOCK, max_num_batched_tokens=64, max_model_len=256)

VARIANTS = {
    "default": dict(),
    "tiny_chunks": dict(max_num_batched_tokens=16),
    "no_chunked_prefill": dict(enable_chunked_prefill=False),
    # 11 usable blocks (176 tokens) for 8 requests of up to ~125 tokens: forces preemption
    "preempt": dict(num_kv_blocks=12),
    "no_prefix_cache_two_seqs": dict(enable_prefix_caching=False, max_num_seqs=2),
    # the in-process worker, on the engine's thread (async scheduling's default is the mp executor)
    "uni_executor_preempt": dict(distributed_executor_backend="uni", num_kv_blocks=12),
    "uni_executor_tiny_chunks": dict(distributed_executor_backend="uni", max_num_batched_tokens=16),
}


@pytest.fixture(autouse=True)
def _mp_defers_outputs(monkeypatch):
    """The mp executor's ranks keep each step's ids on the device on the CPU too (by default they answer
    each step as it ends there: executors/mp.py ``_defers_outputs``)."""
    monkeypatch.setenv("HALSERVE_MP_DEFER_OUTPUTS", "1")


@pytest.fixture(scope="module")
def llama_path(checkpoint_factory):
    return checkpoint_factory("llama")


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1234)
    shared = [rng.randrange(3, 512) for _ in range(40)]  # (prefix-cache hits: two full blocks shared)
    lengths = [1, 13, 16, 53, 101, 7, 33, 23]
    own = [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]
    return own[:5] + [shared + p for p in own[5:]]


def _run(path, prompts, params, device_inputs=True, **kwargs):
    """(token ids per output, per prompt; finish reasons; the engine's stats)"""
    llm = LLM(path, **{**BASE, **kwargs})
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.llm_engine.get_stats()
        async_on = llm.llm_engine.core.scheduler.async_steps is not None
        if async_on and "distributed_executor_backend" not in kwargs:
            assert llm.llm_engine.config.executor_name == "mp", "async scheduling puts the worker in its own process"
        # async: the decode steps' inputs were the step before's ids, gathered on the device (no host sync)
        num_on_device, = llm.llm_engine.core.collective_rpc("num_placeholder_inputs")
        if device_inputs is not None:
            assert (num_on_device > 0) == (async_on and device_inputs), num_on_device
    finally:
        llm.llm_engine.shutdown()
    tokens = [[c.token_ids for c in o.outputs] for o in outputs]
    reasons = [[(c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]
    texts = [[c.text for c in o.outputs] for o in outputs]
    return tokens, reasons, texts, stats, async_on


def _assert_same(path, prompts, params, device_inputs=True, **kwargs):
    sync = _run(path, prompts, params, **kwargs)
    async_ = _run(path, prompts, params, device_inputs, async_scheduling=True, **kwargs)
    assert not sync[4] and async_[4], "async scheduling should be off, then on"
    assert async_[0] == sync[0]
    assert async_[1] == sync[1]
    assert async_[2] == sync[2]
    return sync, async_


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_identical(llama_path, prompts, variant, monkeypatch):
    from halserve.scheduler import Scheduler

    preempted_in_flight = []  # (vLLM shipped a bug here) victims whose step was still running
    preempt = Scheduler._preempt

    def spy(self, request):
        if self.async_steps is not None:
            preempted_in_flight.extend(
                request.request_id for batch in self.async_steps.batches
                if batch.get(request.request_id, (None, False))[1])
        preempt(self, request)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sync, async_ = _assert_same(llama_path, prompts, params, **VARIANTS[variant])
    if variant.endswith("preempt"):
        assert sync[3].num_preemptions > 0 and async_[3].num_preemptions > 0, "the tiny cache should preempt"
        assert preempted_in_flight, "some request should be preempted while its sampling step is in flight"
    if variant == "default":
        assert async_[3].prefix_cache_hits > 0, "the shared prefix should hit the prefix cache"


def test_mixed_max_tokens_stop_ids_and_seeded_n(llama_path, prompts):
    """Per-request max_tokens (1 included: a request done after its prefill), a stop token id taken
    from the synchronous output, and seeded sampling with n = 3, in one batch, with preemption."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    stop_id = _run(llama_path, prompts[1:2], greedy)[0][0][0][6]
    params = [
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id]),
        SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=9, ignore_eos=True),
        # penalties and min_tokens read the tokens so far: the step before's are on the host by sampling time
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.5,
                       frequency_penalty=0.7, presence_penalty=0.4),
        SamplingParams(temperature=1.0, seed=3, max_tokens=12, min_tokens=6, stop_token_ids=[stop_id]),
    ] + [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id]),
        SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=17, ignore_eos=True),
    ]
    for kwargs in (dict(), dict(num_kv_blocks=12), dict(distributed_executor_backend="uni", num_kv_blocks=12)):
        sync, _ = _assert_same(llama_path, prompts, params, **kwargs)
        assert sync[1][0] == [("length", None)]
        assert sync[1][1] == [("stop", stop_id)]
        assert [len(t) for t in sync[0][2]] == [17, 17, 17] and len({tuple(t) for t in sync[0][2]}) > 1


def test_stop_strings(llama_path, prompts):
    """A stop string (matched outside the engine core, one step late with async scheduling) ends
    the request with the same text and tokens."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sync = _run(llama_path, prompts, greedy)
    texts = [t[0] for t in sync[2]]
    stops = [text[len(text) // 3: len(text) // 3 + 3] for text in texts if len(text) > 12]
    assert stops, texts
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=stops[:3])
    sync, _ = _assert_same(llama_path, prompts, params)
    assert any(r[0] == ("stop", s) for r in sync[1] for s in stops[:3]), sync[1]


def test_structured_outputs_step_synchronously(llama_path):
    """A request under a grammar needs each token before its next mask: those steps wait for the
    step in flight; the tokens are the same as without async scheduling."""
    regex = "[a-z]{3,6}(-[0-9]{2,4}){2,5}"
    constrained = SamplingParams(temperature=1.0, seed=7, max_tokens=40, structured_outputs={"regex": regex})
    free = SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
    prompts = [[5 + i] * (60 + 10 * i) for i in range(4)]
    # (whether a step ever runs asynchronously depends on when the grammars compile: not asserted)
    sync, _ = _assert_same(llama_path, prompts, [constrained, free] * 2, device_inputs=None)
    assert sync[1][0][0][0] == "stop"


def test_refused_feature_warns_and_runs_synchronously(llama_path, prompts, caplog):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = _run(llama_path, prompts, params)[0]
    logging.getLogger("halserve").propagate = True
    with caplog.at_level(logging.WARNING, logger="halserve.engine.core"):
        got, _, _, _, async_on = _run(llama_path, prompts, params, async_scheduling=True, speculative_config=spec)
    warnings = [r.getMessage() for r in caplog.records if "async scheduling is off" in r.getMessage()]
    assert warnings == ["async scheduling is off: speculative decoding (speculative_config) cannot run "
                        "asynchronously yet; scheduling synchronously"]
    assert not async_on
    assert got == want


def test_off_by_default(llama_path):
    llm = LLM(llama_path, **BASE)
    try:
        assert llm.llm_engine.config.async_scheduling is False
        assert llm.llm_engine.core.scheduler.async_steps is None
    finally:
        llm.llm_engine.shutdown()


def test_serve_flag_sets_the_config():
    from halserve.entrypoints.cli import build_parser
    from halserve.entrypoints.cli_serve import build_config

    for argv, expected in ((["serve", "m"], False), (["serve", "m", "--async-scheduling"], True)):
        args = build_parser().parse_args(argv)
        assert build_config(args, "m").async_scheduling is expected

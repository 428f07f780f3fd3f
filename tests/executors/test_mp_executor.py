"""The ``mp`` executor: real worker processes, real torch.distributed (gloo), tensor
parallelism end to end on CPU. Engines are shared per module: starting worker
processes (each imports torch) is the slow part."""
from __future__ import annotations

import os
import random
import signal
import time

import psutil
import pytest
from engine_helpers import (
    assert_greedy_matches_one_rank,
    assert_seeded_sampling_is_reproducible,
    generate_ids,
    greedy_params,
    hf_greedy,
)

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')

NEW_TOKENS = 12
ENGINE_KWARGS = dict(platform="cpu", dtype="float32", block_size=16, max_num_batched_tokens=64,
                     num_kv_blocks=64, max_num_seqs=8)


def _greedy(max_tokens: int = NEW_TOKENS):
    return greedy_params(max_tokens)


def _children() -> set[int]:
    """Our descendant processes, zombies included (a zombie is a child nobody reaped)."""
    return {c.pid for c in psutil.Process().children(recursive=True)}


@pytest.fixture(scope="module")
def tp2_llm(llama):
    from halserve import LLM

    path, _ = llama
    llm = LLM(path, tensor_parallel_size=2, **ENGINE_KWARGS)
    yield llm
    llm.llm_engine.shutdown()


def _executor_of(llm):
    return llm.llm_engine.core.executor


def _attention_layout(worker) -> tuple:
    """Run in a worker: (local q heads, local kv heads, KV cache shape) of its first layer."""
    layer = worker.model_runner.model.attention_layers[0]
    backend = worker.model_runner.attn_backend_cls
    return layer.num_heads, layer.num_kv_heads, tuple(layer.kv_cache.shape), backend.kv_cache_shape(64, 16, 1, 16)


def test_mp_is_registered_and_default_for_several_ranks(tp2_llm):
    from halserve.executors.mp import MultiprocExecutor
    from halserve.plugins import get_plugin_manager

    assert get_plugin_manager().executors["mp"].obj is MultiprocExecutor
    executor = _executor_of(tp2_llm)
    assert isinstance(executor, MultiprocExecutor)
    assert len(executor.worker_pids) == 2
    assert set(executor.worker_pids) <= _children()
    executor.check_health()
    # each rank holds half the q heads and one of the two kv heads; its KV cache only that one
    layouts = executor.collective_rpc(_attention_layout)
    assert [(q, kv) for q, kv, _, _ in layouts] == [(2, 1), (2, 1)]
    # the backend's layout for num_kv_blocks=64, block 16, one kv head of size 64/4
    assert all(shape == expected for _, _, shape, expected in layouts)


def test_tp2_greedy_matches_tp1_and_transformers(llama, tp2_llm):
    path, prompts = llama
    assert_greedy_matches_one_rank(path, prompts, tp2_llm, NEW_TOKENS, "tp=2", **ENGINE_KWARGS)


def test_tp2_per_request_state_matches_tp1(llama, tp2_llm):
    """What the model runners keep per request (grammar matchers, prompt logprobs over chunks)
    and the sampler's token lists give the same results on two ranks as on one."""
    import re

    from halserve import LLM, SamplingParams

    path, prompts = llama
    regex = "[a-z]{3}-[0-9]{2}"
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=30, structured_outputs={"regex": regex},
                             prompt_logprobs=1, logit_bias={9: 3.0}) for i in range(len(prompts))]

    def run(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(o.outputs[0].text, [round(d[t].logprob, 3) for d, t in zip(o.prompt_logprobs[1:],
                                                                             o.prompt_token_ids[1:])])
                for o in outs]

    tp1 = LLM(path, **ENGINE_KWARGS)
    try:
        want = run(tp1)
    finally:
        tp1.llm_engine.shutdown()
    got = run(tp2_llm)
    assert got == want
    assert all(re.fullmatch(regex, text) and len(scores) == len(p) - 1 for (text, scores), p in zip(got, prompts))


def test_tp2_replicated_kv_head_tied_odd_vocab(tmp_path):
    """More ranks than kv heads (one kv head, replicated on both ranks), qkv bias (Qwen2),
    tied embeddings and a vocabulary that does not split evenly (padded vocab shards)."""
    from model_factory import make_checkpoint

    from halserve import LLM

    path = make_checkpoint(str(tmp_path), "qwen2", num_layers=2, num_heads=4, num_kv_heads=1, vocab_size=515,
                           tie_word_embeddings=True)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 515) for _ in range(n)] for n in (1, 9, 33)]
    llm = LLM(path, tensor_parallel_size=2, **ENGINE_KWARGS)
    try:
        assert [kv for _, kv, _, _ in _executor_of(llm).collective_rpc(_attention_layout)] == [1, 1]
        got = generate_ids(llm, prompts, _greedy(8))
    finally:
        llm.llm_engine.shutdown()
    assert got == hf_greedy(path, prompts, 8)


def test_tp2_seeded_sampling_is_reproducible(llama, tp2_llm):
    """Random sampling: the ranks must agree on every token (the executor checks each step)
    and a seeded request gives the same tokens every time."""
    _, prompts = llama
    assert_seeded_sampling_is_reproducible(tp2_llm, prompts)


def test_tp2_worker_death_raises_and_shutdown_leaves_no_children(llama, tp2_llm):
    from halserve.executors.mp import WorkerDiedError

    _, prompts = llama
    executor = _executor_of(tp2_llm)
    executor.check_health()
    pids = executor.worker_pids
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(pid \d+\) (died|could not be sent)"):
        generate_ids(tp2_llm, prompts[:1], _greedy(2))
    assert time.monotonic() - start < 30, "a dead worker must be reported, not waited for"
    with pytest.raises(WorkerDiedError, match="rank 1"):
        executor.check_health()
    with pytest.raises(WorkerDiedError, match="unusable"):
        executor.execute_model(None)  # every later call fails at once, before sending anything
    tp2_llm.llm_engine.shutdown()
    assert not set(pids) & _children(), "shutdown must stop and reap every worker"
    executor.shutdown()  # idempotent
    tp2_llm.llm_engine.shutdown()


def test_mp_with_one_rank(llama):
    """``distributed_executor_backend="mp"`` with one rank: a single worker process."""
    from halserve import LLM
    from halserve.executors.mp import MultiprocExecutor, WorkerDiedError

    path, prompts = llama
    llm = LLM(path, tensor_parallel_size=1, distributed_executor_backend="mp", **ENGINE_KWARGS)
    executor = _executor_of(llm)
    pids = executor.worker_pids
    try:
        assert isinstance(executor, MultiprocExecutor) and len(pids) == 1
        assert generate_ids(llm, prompts[:2], _greedy(4)) == [e[:4] for e in hf_greedy(path, prompts[:2], 4)]
        # a failing call on the worker comes back as the worker's own exception type
        with pytest.raises(AttributeError, match="no_such_method"):
            executor.collective_rpc("no_such_method")
        executor.check_health()  # a failed call that every rank answered leaves it usable
    finally:
        executor.shutdown()
    assert not set(pids) & _children()
    executor.shutdown()
    llm.llm_engine.shutdown()
    with pytest.raises(WorkerDiedError, match="shut down"):
        executor.collective_rpc("attention_backend_name")


_ENGINE_SCRIPT = """
import sys, time
if __name__ == "__main__":  # "spawn" workers import the main module
    from halserve import LLM
    llm = LLM(sys.argv[1], platform="cpu", dtype="float32", tensor_parallel_size=2, num_kv_blocks=16)
    print("PIDS", *llm.llm_engine.core.executor.worker_pids, flush=True)
    time.sleep(600)
"""


def test_workers_exit_when_the_engine_process_is_killed(llama, tmp_path):
    """No orphans even without shutdown or atexit: a worker leaves when its pipe closes."""
    import subprocess
    import sys

    path, _ = llama
    script = tmp_path / "engine.py"
    script.write_text(_ENGINE_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), path], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()  # blocks until the engine is up (or the script died)
        assert line.startswith("PIDS"), f"engine script failed (exit code {proc.poll()})"
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 20
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    assert alive == [], f"orphaned workers {alive}"

"""KV connectors end to end on the CPU: real engines (``LLM``), real K/V files, real host pools.
The greedy tokens of an engine that loads K/V must equal those of a plain engine that computes it;
tampering with a saved file must change the result (the loaded K/V is really used)."""
from __future__ import annotations

import glob
import logging
import os

import pytest

from halserve import LLM, SamplingParams

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')

PROMPTS = [[(7 * i + j) % 500 + 3 for j in range(70)] for i in range(3)]  # 4 full blocks of 16, and 6 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=1)


def storage(path, role="kv_both", **extra):
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(path), **extra}}


def generate(llm, prompts=PROMPTS, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def first_logprobs(outputs):
    return [o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob for o in outputs]


def run_engine(model, **kwargs):
    llm = LLM(model, num_kv_blocks=64, **kwargs)
    try:
        outputs = generate(llm)
        return outputs, llm.llm_engine.get_stats()
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("backends", [("cpu_native", "cpu_native"), ("cpu_native", "torch"), ("torch", "cpu_native")])
def test_a_second_engine_loads_the_first_ones_prompt_kv(tiny_llama, reference, tmp_path, backends):
    first, stats = run_engine(tiny_llama, kv_transfer_config=storage(tmp_path), attention_backend=backends[0])
    assert tokens(first) == tokens(reference) and stats.kv_connector_hit_tokens == 0
    # 70 prompt + 7 computed output tokens: 4 full blocks per prompt, one file each
    assert len(glob.glob(str(tmp_path / "*" / "tp1-r0" / "*" / "*.safetensors"))) == 12
    second, stats = run_engine(tiny_llama, kv_transfer_config=storage(tmp_path), attention_backend=backends[1])
    assert tokens(second) == tokens(reference)
    assert [o.num_cached_tokens for o in second] == [64, 64, 64] and stats.kv_connector_hit_tokens == 192
    assert first_logprobs(second) == pytest.approx(first_logprobs(reference), abs=1e-4)


def test_tampered_kv_changes_the_result_and_unreadable_kv_is_recomputed(tiny_llama, reference, tmp_path, caplog):
    run_engine(tiny_llama, kv_transfer_config=storage(tmp_path, namespace="ns"))
    from safetensors.torch import load_file, save_file

    files = sorted(glob.glob(str(tmp_path / "ns" / "tp1-r0" / "*" / "*.safetensors")))
    for path in files:  # every block's K/V scaled: a well-formed file with other content
        save_file({"kv": load_file(path)["kv"] * 3}, path)
    tampered, _ = run_engine(tiny_llama, kv_transfer_config=storage(tmp_path, namespace="ns"))
    assert first_logprobs(tampered) != pytest.approx(first_logprobs(reference), abs=1e-3)

    for path in files:
        with open(path, "wb") as f:
            f.write(b"not a safetensors file")
    with caplog.at_level(logging.WARNING):
        recomputed, stats = run_engine(tiny_llama, kv_transfer_config=storage(tmp_path, namespace="ns"))
    assert tokens(recomputed) == tokens(reference)
    assert first_logprobs(recomputed) == pytest.approx(first_logprobs(reference), abs=1e-4)
    assert "cannot load KV block" in caplog.text and "recomputing 3 requests" in caplog.text


def test_producer_only_saves_and_consumer_only_loads(tiny_llama, reference, tmp_path):
    outputs, stats = run_engine(tiny_llama, kv_transfer_config=storage(tmp_path, "kv_producer"))
    assert tokens(outputs) == tokens(reference)
    files = set(glob.glob(str(tmp_path / "**" / "*.safetensors"), recursive=True))
    assert len(files) == 12
    again, stats = run_engine(tiny_llama, kv_transfer_config=storage(tmp_path, "kv_producer"))
    assert stats.kv_connector_hit_tokens == 0  # a producer never loads
    consumer_dir = tmp_path / "consumer"
    outputs, stats = run_engine(tiny_llama, kv_transfer_config=storage(consumer_dir, "kv_consumer"))
    assert tokens(outputs) == tokens(reference) and not glob.glob(str(consumer_dir / "**" / "*.safetensors"),
                                                                  recursive=True)
    outputs, stats = run_engine(tiny_llama, kv_transfer_config=storage(tmp_path, "kv_consumer"))
    assert stats.kv_connector_hit_tokens == 192 and tokens(outputs) == tokens(reference)
    assert set(glob.glob(str(tmp_path / "**" / "*.safetensors"), recursive=True)) == files


@pytest.mark.parametrize("how", ["kv_transfer_config", "kv_offloading_size"])
def test_offloading_brings_back_evicted_prefixes(tiny_llama, reference, how):
    kwargs = ({"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                                      "kv_connector_extra_config": {"num_cpu_blocks": 40}}}
              if how == "kv_transfer_config" else {"kv_offloading_size": 0.01})
    # 7 blocks (6 usable) hold one request at a time: each prompt evicts the one before
    llm = LLM(tiny_llama, num_kv_blocks=7, max_num_seqs=1, **kwargs)
    try:
        first = generate(llm)
        assert tokens(first) == tokens(reference) and [o.num_cached_tokens for o in first] == [0, 0, 0]
        second = generate(llm)
        assert tokens(second) == tokens(reference)
        assert [o.num_cached_tokens for o in second] == [64, 64, 64]
        stats = llm.llm_engine.get_stats()
        assert stats.kv_connector_hit_tokens == 192 and stats.prefix_cache_hits == 0
    finally:
        llm.llm_engine.shutdown()


def test_offloading_rows_that_do_not_hold_their_block_are_recomputed(tiny_llama, reference, caplog):
    """A save that did not complete (its row's key is cleared first) is a failed load, never another
    block's K/V."""
    cfg = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"num_cpu_blocks": 40}}
    llm = LLM(tiny_llama, num_kv_blocks=7, max_num_seqs=1, kv_transfer_config=cfg)
    try:
        generate(llm)
        worker_side = llm.llm_engine.core.executor.worker.model_runner.kv_connector
        worker_side._row_keys[:] = [None] * len(worker_side._row_keys)
        with caplog.at_level(logging.WARNING):
            second = generate(llm)
        assert tokens(second) == tokens(reference)
        assert "recomputing" in caplog.text
    finally:
        llm.llm_engine.shutdown()


def test_offloading_pool_smaller_than_the_working_set_keeps_the_latest(tiny_llama, reference):
    cfg = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"num_cpu_blocks": 5}}
    llm = LLM(tiny_llama, num_kv_blocks=7, max_num_seqs=1, kv_transfer_config=cfg)
    try:
        generate(llm)  # 12 blocks through 5 rows: the last prompt's 4 (and one of the one before) stay
        last, first = generate(llm, PROMPTS[2:]), generate(llm, PROMPTS[:1])
        assert tokens(last) + tokens(first) == [tokens(reference)[2], tokens(reference)[0]]
        assert last[0].num_cached_tokens == 64 and first[0].num_cached_tokens == 0
    finally:
        llm.llm_engine.shutdown()


def test_tensor_parallel_ranks_save_and_load_their_heads(tiny_llama, reference, tmp_path):
    first, _ = run_engine(tiny_llama, kv_transfer_config=storage(tmp_path, namespace="tp"), tensor_parallel_size=2)
    assert sorted(os.listdir(tmp_path / "tp")) == ["tp2-r0", "tp2-r1"]
    second, stats = run_engine(tiny_llama, kv_transfer_config=storage(tmp_path, namespace="tp"),
                               tensor_parallel_size=2)
    assert tokens(first) == tokens(second) == tokens(reference)
    assert stats.kv_connector_hit_tokens == 192
    one_rank, stats = run_engine(tiny_llama, kv_transfer_config=storage(tmp_path, namespace="tp"))
    assert stats.kv_connector_hit_tokens == 0  # (a one-rank engine needs whole heads: tp1 files)


@pytest.mark.parametrize("kwargs, message", [
    ({"kv_transfer_config": {"kv_connector": "Nope"}}, "unknown kv_connector 'Nope'; registered KV connectors: "),
    ({"kv_transfer_config": {"kv_connector": "SharedStorageConnector"}}, 'needs kv_connector_extra_config '
                                                                         '"shared_storage_path"'),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector"}}, "needs exactly one of"),
    ({"kv_transfer_config": storage("/tmp", max_storage_bytes=-1)}, "max_storage_bytes must be a positive integer"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                             "kv_connector_extra_config": {"num_cpu_blocks": 8, "block_size": 64}}},
     "block_size 64 differs from the engine's block_size 16"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": "kv_producer",
                             "kv_connector_extra_config": {"num_cpu_blocks": 8}}}, "kv_role must be 'kv_both'"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                             "kv_connector_extra_config": {"num_cpu_blocks": 0}}}, "must be a positive integer"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                             "kv_connector_extra_config": {"num_cpu_blocks": 8, "gpu": 1}}}, "unknown key(s) gpu"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                             "kv_connector_extra_config": {"cpu_bytes_to_use": 100}}}, "holds no block"),
    ({"kv_transfer_config": {"kv_connector": "X", "kv_connector_module_path": "no_such_module_x"}},
     "cannot be imported"),
    ({"kv_transfer_config": {"kv_connector": "LLM", "kv_connector_module_path": "halserve"}},
     "is not a halserve.kv_connectors.base.KVConnector subclass"),
    ({"kv_transfer_config": '{"kv_connector": "OffloadingConnector"', }, "kv_transfer_config is not valid JSON"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": "both"}}, "kv_role"),
    ({"kv_offloading_size": 1, "kv_transfer_config": {"kv_connector": "OffloadingConnector"}},
     "kv_offloading_size and kv_transfer_config both"),
    ({"kv_offloading_size": 1, "pipeline_parallel_size": 2}, "does not work with pipeline parallelism"),
])
def test_bad_connector_settings_are_refused_with_the_reason(tiny_llama, kwargs, message):
    with pytest.raises(ValueError) as info:
        LLM(tiny_llama, num_kv_blocks=64, **kwargs)
    assert message in str(info.value)


def test_max_storage_bytes_prunes_the_least_recently_used_files(tiny_llama, reference, tmp_path):
    """A cap of ~5 blocks: the producer deletes the oldest files at the step after it saved 12; the
    blocks left still serve a second engine, each prompt its leading blocks that survived."""
    from halserve.kv_cache.hashing import hash_block_tokens

    run_engine(tiny_llama, kv_transfer_config=storage(tmp_path / "probe"))
    block_file = max(p.stat().st_size for p in (tmp_path / "probe").rglob("*.safetensors"))
    cap = 5 * block_file
    config = storage(tmp_path / "kv", max_storage_bytes=cap)
    first, _ = run_engine(tiny_llama, kv_transfer_config=config)
    files = {p.stem for p in (tmp_path / "kv").rglob("*.safetensors")}
    assert tokens(first) == tokens(reference) and 0 < len(files) * block_file <= cap
    expected_hits = 0
    for prompt in PROMPTS:  # a prompt's hit: its leading blocks whose file survived
        parent = None
        for b in range(len(prompt) // 16):
            parent = hash_block_tokens(parent, prompt[16 * b : 16 * b + 16])
            if parent.hex() not in files:
                break
            expected_hits += 16
    second, stats = run_engine(tiny_llama, kv_transfer_config=config)
    assert tokens(second) == tokens(reference) and stats.kv_connector_hit_tokens == expected_hits

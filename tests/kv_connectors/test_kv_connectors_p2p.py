"""``P2pConnector``: a consumer engine pulls prompt K/V from a producer engine over TCP (both real
engines; here in one process, or in worker processes with tensor parallelism)."""
from __future__ import annotations

import logging

import pytest
from server_utils import free_port
from test_kv_connectors_engine import PROMPTS, first_logprobs, generate, tokens

from halserve import LLM

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')


def producer_config(port, rows=64):
    return {"kv_connector": "P2pConnector", "kv_role": "kv_producer", "kv_port": port,
            "kv_connector_extra_config": {"num_cpu_blocks": rows}}


def consumer_config(port):
    return {"kv_connector": "P2pConnector", "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"peer": f"127.0.0.1:{port}"}}


@pytest.fixture()
def producer(tiny_llama):
    port = free_port()
    llm = LLM(tiny_llama, num_kv_blocks=64, kv_transfer_config=producer_config(port))
    try:
        yield llm, port
    finally:
        llm.llm_engine.shutdown()


def run_consumer(model, port, prompts=PROMPTS, **kwargs):
    llm = LLM(model, num_kv_blocks=64, kv_transfer_config=consumer_config(port), **kwargs)
    try:
        return generate(llm, prompts), llm.llm_engine.get_stats()
    finally:
        llm.llm_engine.shutdown()


def test_consumer_pulls_what_the_producer_computed(tiny_llama, reference, producer):
    llm, port = producer
    assert tokens(generate(llm)) == tokens(reference)
    outputs, stats = run_consumer(tiny_llama, port)
    assert tokens(outputs) == tokens(reference)
    assert [o.num_cached_tokens for o in outputs] == [64, 64, 64] and stats.kv_connector_hit_tokens == 192
    assert first_logprobs(outputs) == pytest.approx(first_logprobs(reference), abs=1e-4)
    outputs, stats = run_consumer(tiny_llama, port, [[9, 8, 7] * 30])  # unknown to the producer
    assert stats.kv_connector_hit_tokens == 0


def test_rows_reused_after_the_lookup_are_recomputed(tiny_llama, reference, producer, caplog):
    llm, port = producer
    generate(llm)
    worker_side = llm.llm_engine.core.executor.worker.model_runner.kv_connector
    worker_side._row_keys[:] = [None] * len(worker_side._row_keys)  # as if other blocks took the rows
    with caplog.at_level(logging.WARNING):
        outputs, stats = run_consumer(tiny_llama, port)
    assert tokens(outputs) == tokens(reference)
    assert "recomputing 3 requests" in caplog.text


def test_an_absent_producer_means_no_hits(tiny_llama, reference, caplog):
    with caplog.at_level(logging.WARNING):
        outputs, stats = run_consumer(tiny_llama, free_port())
    assert tokens(outputs) == tokens(reference) and stats.kv_connector_hit_tokens == 0
    assert "did not answer a lookup" in caplog.text


def test_tensor_parallel_producer_and_consumer(tiny_llama, reference):
    port = free_port()
    llm = LLM(tiny_llama, num_kv_blocks=64, kv_transfer_config=producer_config(port), tensor_parallel_size=2)
    try:
        assert tokens(generate(llm)) == tokens(reference)
        outputs, stats = run_consumer(tiny_llama, port, tensor_parallel_size=2)
        assert tokens(outputs) == tokens(reference) and stats.kv_connector_hit_tokens == 192
        outputs, stats = run_consumer(tiny_llama, port)  # one rank: the producer's two halves do not fit
        assert tokens(outputs) == tokens(reference) and stats.kv_connector_hit_tokens == 0
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("config, message", [
    ({"kv_role": "kv_both", "kv_connector_extra_config": {"num_cpu_blocks": 8}}, "not 'kv_both'"),
    ({"kv_role": "kv_consumer", "kv_connector_extra_config": {}}, '"peer" (the producer\'s kv_ip:kv_port) must be'),
    ({"kv_role": "kv_consumer", "kv_connector_extra_config": {"peer": "host"}}, 'must be "host:port"'),
    ({"kv_role": "kv_consumer", "kv_connector_extra_config": {"peer": "h:1", "num_cpu_blocks": 4}},
     "a consumer keeps no pool"),
    ({"kv_role": "kv_producer", "kv_connector_extra_config": {}}, "needs exactly one of"),
    ({"kv_role": "kv_producer", "kv_connector_extra_config": {"num_cpu_blocks": 4, "peer": "h:1"}},
     '"peer" is for the consumer'),
])
def test_bad_p2p_settings(tiny_llama, config, message):
    with pytest.raises(ValueError) as info:
        LLM(tiny_llama, num_kv_blocks=64, kv_transfer_config={"kv_connector": "P2pConnector", **config})
    assert message in str(info.value)


def test_a_taken_port_is_a_clear_error(tiny_llama, producer):
    _, port = producer
    with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
        LLM(tiny_llama, num_kv_blocks=64, kv_transfer_config=producer_config(port))

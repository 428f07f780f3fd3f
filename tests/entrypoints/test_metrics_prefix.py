"""--metrics-prefix vllm: the names vLLM's stock Grafana dashboard reads are exposed, under ``vllm:``."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from halserve.engine.types import EngineStats
from halserve.entrypoints.openai.metrics import ServerMetrics

# Every series examples/online_serving/prometheus_grafana/grafana.json (vLLM) queries, that halserve has.
DASHBOARD_SERIES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:gpu_cache_usage_perc",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:request_prompt_tokens_bucket",
]


def _stats() -> EngineStats:
    return EngineStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, prefix_cache_queries=0,
                       prefix_cache_hits=0, num_preemptions=0)


def _scrape(metrics: ServerMetrics) -> dict[str, list[tuple[dict, float]]]:
    samples: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


@pytest.fixture(autouse=True)
def _no_multiprocess(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)


def test_vllm_prefix_exposes_the_dashboard_names():
    metrics = ServerMetrics("m", _stats, prefix="vllm")
    metrics.on_request_added(7)
    metrics.on_new_tokens(1, ttft=0.05, itl=None)
    metrics.on_new_tokens(2, ttft=None, itl=0.02)
    metrics.on_request_finished("stop", 0.3)
    samples = _scrape(metrics)
    missing = [name for name in DASHBOARD_SERIES if name not in samples]
    assert not missing, f"not exposed: {missing}"
    assert not [name for name in samples if name.startswith("halserve:")]
    assert samples["vllm:num_requests_running"] == [({"model_name": "m"}, 3.0)]
    assert samples["vllm:gpu_cache_usage_perc"] == [({"model_name": "m"}, 0.25)]
    assert samples["vllm:prompt_tokens_total"] == [({"model_name": "m"}, 7.0)]
    assert samples["vllm:generation_tokens_total"] == [({"model_name": "m"}, 3.0)]
    assert ({"model_name": "m", "finished_reason": "stop"}, 1.0) in samples["vllm:request_success_total"]
    assert samples["vllm:time_per_output_token_seconds_count"] == [({"model_name": "m"}, 2.0)]
    assert samples["vllm:request_prompt_tokens_count"] == [({"model_name": "m"}, 1.0)]


def test_default_prefix_is_halserve_without_the_legacy_aliases():
    samples = _scrape(ServerMetrics("m", _stats))
    assert "halserve:num_requests_running" in samples
    assert "halserve:kv_cache_usage_perc" in samples
    assert not [name for name in samples if name.startswith("vllm:")]
    assert "halserve:gpu_cache_usage_perc" not in samples  # (vLLM's legacy names come with the vllm prefix only)


def test_unknown_prefix_is_refused():
    with pytest.raises(ValueError, match="'sglang' is not one of halserve, vllm"):
        ServerMetrics("m", _stats, prefix="sglang")

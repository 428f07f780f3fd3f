"""Prometheus metrics at GET /metrics, with vLLM's names under ``halserve:`` (``--metrics-prefix
vllm``: under ``vllm:``, plus the older names vLLM's stock Grafana dashboard still reads --
``gpu_cache_usage_perc``, ``time_per_output_token_seconds`` -- so it works unchanged).

Two sources, one registry (never the global one, so several servers or tests in one
process do not collide):

- engine state (running/waiting requests, KV-cache usage overall and per KV-cache group,
  prefix-cache and preemption counters, tokens per engine step, the LoRA adapters of running and
  waiting requests) is read from ``AsyncLLM.get_stats()`` when Prometheus scrapes;
- per-request figures (prompt/generation tokens, TTFT, inter-token latency, end-to-end
  latency, the queue / prefill / decode / inference phases, finished requests by reason) are
  pushed by the engine as they happen (``ServerMetrics`` is an ``AsyncLLM`` stats observer).

With several API-server processes (``--api-server-count``, ``PROMETHEUS_MULTIPROC_DIR`` set) the
per-request figures are prometheus_client's multiprocess values, summed over the servers at
scrape time; the engine state is the engine's own (every server holds its latest snapshot).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from halserve.engine.request_stream import FinishedRequestStats
from halserve.engine.types import EngineStats
from halserve.scheduler import ITERATION_TOKENS_BUCKETS

__all__ = ["CONTENT_TYPE_LATEST", "METRICS_PREFIXES", "ServerMetrics"]

METRICS_PREFIXES = ("halserve", "vllm")  # --metrics-prefix: the part of each metric name before the ':'

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))  # 1, 2, 5, 10, ... 500000 tokens
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)


class _EngineStatsCollector(Collector):
    """Gauges and engine counters, read from the latest stats snapshot at scrape time."""

    def __init__(self, get_stats: Callable[[], EngineStats], model_name: str, prefix: str) -> None:
        self._get_stats = get_stats
        self._model_name = model_name
        self._prefix = prefix

    def collect(self) -> Iterator[Metric]:
        stats = self._get_stats()
        labels = ["model_name"]
        values = [self._model_name]
        gauges = [
            ("num_requests_running", "Requests in the running batch.", stats.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("kv_cache_usage_perc", "KV-cache usage (1 = full).", stats.kv_cache_usage),
        ]
        if self._prefix == "vllm":  # (the name vLLM's stock dashboard reads; vLLM renamed it kv_cache_usage_perc)
            gauges.append(("gpu_cache_usage_perc", "KV-cache usage (1 = full); kv_cache_usage_perc's older name.",
                           stats.kv_cache_usage))
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(f"{self._prefix}:{name}", doc, labels=labels)
            gauge.add_metric(values, float(value))
            yield gauge
        for name, doc, value in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
            ("num_preemptions", "Requests preempted (recomputed later).", stats.num_preemptions),
            ("kv_connector_hit_tokens", "Prompt tokens a KV connector loaded instead of computing.",
             stats.kv_connector_hit_tokens),
            ("spec_decode_num_drafts", "Decode steps that checked draft tokens.", stats.spec_num_drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens checked.", stats.spec_num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", stats.spec_num_accepted_tokens),
        ):
            counter = CounterMetricFamily(f"{self._prefix}:{name}", doc, labels=labels)
            counter.add_metric(values, float(value))
            yield counter
        yield from self._kv_cache_groups(stats, labels, values)
        yield from self._iteration_tokens(stats, labels, values)
        if stats.max_loras:
            # vLLM's: one series, its labels the adapters' names, its value when the snapshot was read
            info = GaugeMetricFamily(f"{self._prefix}:lora_requests_info", "LoRA adapters of running and waiting "
                                     "requests (comma-separated names); the value is the time of the snapshot.",
                                     labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
            info.add_metric([",".join(stats.running_lora_adapters), ",".join(stats.waiting_lora_adapters),
                             str(stats.max_loras)], time.time())
            yield info

    def _kv_cache_groups(self, stats: EngineStats, labels: list[str], values: list[str]) -> Iterator[Metric]:
        """Per KV-cache group (a Gemma-style model: its full-attention and sliding-window groups): the
        share of the pool's usable blocks that group's requests hold (the groups sum to kv_cache_usage_perc)."""
        gauge = GaugeMetricFamily(
            f"{self._prefix}:kv_cache_group_usage_perc", "KV-cache usage of one KV-cache group: blocks its "
            "requests hold over the pool's usable blocks (the groups sum to kv_cache_usage_perc).",
            labels=[*labels, "kv_cache_group", "kind"])
        kinds = stats.kv_cache_group_kinds or ("full_attention",) * len(stats.kv_cache_group_usage)
        for index, (usage, kind) in enumerate(zip(stats.kv_cache_group_usage, kinds)):
            gauge.add_metric([*values, str(index), kind], float(usage))
        yield gauge

    def _iteration_tokens(self, stats: EngineStats, labels: list[str], values: list[str]) -> Iterator[Metric]:
        """Tokens scheduled per engine step (prefill chunks and decodes together), cumulated in the core."""
        counts = stats.iteration_tokens_counts or (0,) * (len(ITERATION_TOKENS_BUCKETS) + 1)
        histogram = HistogramMetricFamily(f"{self._prefix}:iteration_tokens_total", "Tokens per engine step.",
                                          labels=labels)
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, map(float, ITERATION_TOKENS_BUCKETS)), "+Inf"], counts):
            cumulative += count
            buckets.append((bound, float(cumulative)))
        histogram.add_metric(values, buckets, sum_value=float(stats.iteration_tokens_sum))
        yield histogram


class ServerMetrics:
    """The server's registry; an ``AsyncLLM`` stats observer."""

    def __init__(self, model_name: str, get_stats: Callable[[], EngineStats], prefix: str = "halserve") -> None:
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix {prefix!r} is not one of {', '.join(METRICS_PREFIXES)}")
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        # multiprocess mode: the values live in files every server's scrape sums, not in a registry
        r = None if multiprocess_dir else self.registry

        def counter(name: str, doc: str, extra_labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{prefix}:{name}", doc, [*labels, *extra_labels], registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"{prefix}:{name}", doc, labels, buckets=buckets, registry=r)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.").labels(model_name)
        self._request_success = counter("request_success", "Finished requests, by finish reason.", ("finished_reason",))
        self._model_name = model_name
        for reason in ("stop", "length", "abort"):
            self._request_success.labels(model_name, reason)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS).labels(model_name)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS).labels(model_name)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens.", _ITL_BUCKETS).labels(model_name)
        # vLLM's older name of the same figure, which its stock Grafana dashboard plots
        self.tpot = histogram("time_per_output_token_seconds", "Time between tokens (inter_token_latency_seconds' "
                              "older name).", _ITL_BUCKETS).labels(model_name) if prefix == "vllm" else None
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             _E2E_BUCKETS).labels(model_name)
        # a finished request's phases (FinishedRequestStats): the names and buckets of vLLM's
        self.queue_time = histogram("request_queue_time_seconds", "Time waiting, arrival to first scheduled.",
                                    _E2E_BUCKETS).labels(model_name)
        self.prefill_time = histogram("request_prefill_time_seconds", "Prefill time, first scheduled to first "
                                      "token.", _E2E_BUCKETS).labels(model_name)
        self.decode_time = histogram("request_decode_time_seconds", "Decode time, first token to last token.",
                                     _E2E_BUCKETS).labels(model_name)
        self.inference_time = histogram("request_inference_time_seconds", "Inference time, first scheduled to "
                                        "last token.", _E2E_BUCKETS).labels(model_name)
        if multiprocess_dir:
            from prometheus_client import multiprocess

            multiprocess.MultiProcessCollector(self.registry, path=multiprocess_dir)
        self.registry.register(_EngineStatsCollector(get_stats, model_name, prefix))

    # -- StatsObserver -------------------------------------------------------------
    def on_request_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.request_prompt_tokens.observe(num_prompt_tokens)

    def on_new_tokens(self, num_new_tokens: int, ttft: float | None, itl: float | None) -> None:
        self.generation_tokens.inc(num_new_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
        if itl is not None:
            for _ in range(num_new_tokens):
                self.itl.observe(itl)
                if self.tpot is not None:
                    self.tpot.observe(itl)

    def on_request_finished(self, finish_reason: str, e2e_latency: float) -> None:
        self._request_success.labels(self._model_name, finish_reason).inc()
        self.e2e.observe(e2e_latency)

    def on_request_stats(self, stats: FinishedRequestStats) -> None:
        """The phases a request went through (an abort while waiting has none: nothing observed)."""
        for histogram, value in ((self.queue_time, stats.queue_time), (self.prefill_time, stats.prefill_time),
                                 (self.decode_time, stats.decode_time), (self.inference_time, stats.inference_time)):
            if value is not None:
                histogram.observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)

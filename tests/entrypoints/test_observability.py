"""Observability (issue 30 item 4, issue 29's per-group metric): OpenTelemetry spans received by an
OTLP/HTTP receiver the tests start, one request-log line per request, the per-phase and per-step
histograms, the LoRA info gauge, and the per-KV-cache-group usage gauge against a hand count."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client.parser import text_string_to_metric_families

from halserve.engine.request_stream import FinishedRequestStats
from halserve.engine.types import EngineStats
from halserve.entrypoints.openai.metrics import ServerMetrics
from halserve.sampling_params import SamplingParams
from halserve.scheduler import ITERATION_TOKENS_BUCKETS

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN_ID = "b7ad6b7169203331"


class OTLPReceiver:
    """A local OTLP/HTTP traces endpoint: decodes each POST /v1/traces body (protobuf)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        received = self.requests = []
        paths = self.paths = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    import gzip

                    body = gzip.decompress(body)
                message = ExportTraceServiceRequest()
                message.ParseFromString(body)
                paths.append(self.path)
                received.append(message)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list:
        return [span for request in self.requests for rs in request.resource_spans for ss in rs.scope_spans
                for span in ss.spans]

    def wait_spans(self, count: int, timeout: float = 20.0) -> list:
        deadline = time.monotonic() + timeout
        while len(self.spans()) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.spans()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        which = kv.value.WhichOneof("value")
        value = getattr(kv.value, which)
        out[kv.key] = [getattr(v, v.WhichOneof("value")) for v in value.values] if which == "array_value" else value
    return out


@pytest.fixture
def receiver():
    pytest.importorskip("opentelemetry.sdk", reason="the tracing tests need the dev extra's opentelemetry-sdk")
    r = OTLPReceiver()
    yield r
    r.close()


def _stats(**overrides) -> FinishedRequestStats:
    fields = dict(
        request_id="cmpl-1", finish_reason="length", num_prompt_tokens=7, num_generation_tokens=5,
        num_cached_tokens=0, params=SamplingParams(temperature=0.5, top_p=0.9, max_tokens=5), n=1, max_tokens=5,
        lora_name=None, arrival_time=1000.0, first_scheduled_time=1000.25, first_token_time=1001.0,
        last_token_time=1003.0, finished_time=1003.5, prompt_text="hello there", trace_headers=None)
    fields.update(overrides)
    return FinishedRequestStats(**fields)


def _scrape(text: str) -> dict[str, list[tuple[dict, float]]]:
    samples: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


@pytest.fixture
def _no_multiprocess(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)


# ---------------------------------------------------------------- phases, log lines, spans (no model)
def test_phases_follow_the_timestamps():
    s = _stats()
    assert (s.queue_time, s.ttft, s.prefill_time, s.decode_time, s.inference_time, s.e2e_time) == (
        0.25, 1.0, 0.75, 2.0, 2.75, 3.5)
    waiting = _stats(first_scheduled_time=None, first_token_time=None, last_token_time=None, finish_reason="abort")
    assert (waiting.queue_time, waiting.ttft, waiting.prefill_time, waiting.decode_time,
            waiting.inference_time) == (None,) * 5


def test_request_log_line_holds_prompts_only_when_asked(caplog):
    from halserve.entrypoints.request_logger import RequestLogger

    with caplog.at_level("INFO", logger="halserve.requests"):
        RequestLogger("tiny").on_request_stats(_stats())
        RequestLogger("tiny", log_prompts=True, max_prompt_chars=5).on_request_stats(_stats(request_id="cmpl-2"))
    lines = [r.getMessage() for r in caplog.records if r.name == "halserve.requests"]
    assert len(lines) == 2 and all(line.startswith("request {") for line in lines)
    first, second = (json.loads(line.removeprefix("request ")) for line in lines)
    assert first == {"id": "cmpl-1", "model": "tiny", "lora": None, "prompt_tokens": 7, "generated_tokens": 5,
                     "cached_tokens": 0, "n": 1, "finish_reason": "length", "queue_s": 0.25, "ttft_s": 1.0,
                     "prefill_s": 0.75, "decode_s": 2.0, "inference_s": 2.75, "e2e_s": 3.5}
    assert second["id"] == "cmpl-2" and second["prompt"] == "hello"


def test_tracer_sends_vllms_span_to_an_otlp_receiver(receiver):
    from halserve.tracing import RequestTracer

    tracer = RequestTracer(receiver.url.removesuffix("/v1/traces"), "tiny")  # (a collector's root URL: /v1/traces added)
    tracer.on_request_stats(_stats(trace_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"}))
    tracer.on_request_stats(_stats(request_id="cmpl-2", first_scheduled_time=None, first_token_time=None,
                                   last_token_time=None, num_generation_tokens=0, finish_reason="abort"))
    tracer.shutdown()
    spans = {attributes(s)["gen_ai.request.id"]: s for s in receiver.wait_spans(2)}
    assert set(spans) == {"cmpl-1", "cmpl-2"} and set(receiver.paths) == {"/v1/traces"}
    span = spans["cmpl-1"]
    assert span.name == "llm_request" and span.kind == span.SPAN_KIND_SERVER
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_SPAN_ID
    assert (span.start_time_unix_nano, span.end_time_unix_nano) == (1000 * 10**9, 1003_500_000_000)
    attrs = attributes(span)
    for key, want in {"gen_ai.usage.prompt_tokens": 7, "gen_ai.usage.completion_tokens": 5,
                      "gen_ai.usage.cached_tokens": 0, "gen_ai.request.max_tokens": 5, "gen_ai.request.n": 1,
                      "gen_ai.request.temperature": 0.5, "gen_ai.request.top_p": 0.9,
                      "gen_ai.response.model": "tiny", "gen_ai.response.finish_reasons": ["length"],
                      "gen_ai.latency.time_in_queue": 0.25, "gen_ai.latency.time_to_first_token": 1.0,
                      "gen_ai.latency.time_in_model_prefill": 0.75, "gen_ai.latency.time_in_model_decode": 2.0,
                      "gen_ai.latency.time_in_model_inference": 2.75, "gen_ai.latency.e2e": 3.5}.items():
        assert attrs[key] == pytest.approx(want) if isinstance(want, float) else attrs[key] == want, key
    aborted = attributes(spans["cmpl-2"])  # (never scheduled: no phase attributes, a trace of its own)
    assert "gen_ai.latency.time_in_queue" not in aborted and "gen_ai.latency.time_in_model_decode" not in aborted
    assert spans["cmpl-2"].parent_span_id == b"" and spans["cmpl-2"].trace_id.hex() != TRACE_ID


def test_tracing_without_the_sdk_names_the_pip_command(monkeypatch, capsys):
    from halserve.entrypoints.cli import main

    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # (an import of it raises ImportError)
    assert main(["serve", "--platform", "cpu", "--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces"]) == 2
    assert "pip install 'halserve[otel]'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--log-request-prompts"], "--log-request-prompts needs --enable-log-requests"),
    (["--enable-log-requests", "--max-log-len", "10"], "--max-log-len needs --log-request-prompts"),
    (["--otlp-traces-endpoint", "localhost:4317"], "give the OTLP/HTTP URL of a collector"),
])
def test_bad_observability_flags_are_usage_errors(argv, message, capsys):
    from halserve.entrypoints.cli import main

    assert main(["serve", "--platform", "cpu", *argv]) == 2
    assert message in capsys.readouterr().err


def test_import_halserve_does_not_import_the_sdk():
    # (FastAPI imports opentelemetry's API package when it is installed; the SDK and exporter are ours to load)
    code = ("import sys, halserve, halserve.engine.async_llm, halserve.entrypoints.openai.api_server; "
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------- /metrics from engine stats
def test_engine_state_metrics(_no_multiprocess):
    counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    counts[0], counts[2], counts[-1] = 3, 1, 1  # 3 one-token steps, one of 9..16 tokens, one past the last bound
    stats = EngineStats(kv_cache_group_usage=(0.5, 0.125), kv_cache_group_kinds=("sliding_window", "full_attention"),
                        iteration_tokens_counts=tuple(counts), iteration_tokens_sum=3 + 12 + 20000, max_loras=2,
                        running_lora_adapters=("a", "b"), waiting_lora_adapters=("c",))
    metrics = ServerMetrics("m", lambda: stats, prefix="vllm")
    metrics.on_request_stats(_stats())
    samples = _scrape(metrics.render().decode())
    assert sorted(samples["vllm:kv_cache_group_usage_perc"], key=lambda s: s[0]["kv_cache_group"]) == [
        ({"model_name": "m", "kv_cache_group": "0", "kind": "sliding_window"}, 0.5),
        ({"model_name": "m", "kv_cache_group": "1", "kind": "full_attention"}, 0.125)]
    buckets = {labels["le"]: value for labels, value in samples["vllm:iteration_tokens_total_bucket"]}
    assert (buckets["1.0"], buckets["8.0"], buckets["16.0"], buckets["16384.0"], buckets["+Inf"]) == (3, 3, 4, 4, 5)
    assert samples["vllm:iteration_tokens_total_count"] == [({"model_name": "m"}, 5.0)]
    assert samples["vllm:iteration_tokens_total_sum"] == [({"model_name": "m"}, 20015.0)]
    ((labels, _),) = samples["vllm:lora_requests_info"]
    assert labels == {"running_lora_adapters": "a,b", "waiting_lora_adapters": "c", "max_lora": "2"}
    for name, value in (("queue_time", 0.25), ("prefill_time", 0.75), ("decode_time", 2.0),
                        ("inference_time", 2.75)):
        assert samples[f"vllm:request_{name}_seconds_count"] == [({"model_name": "m"}, 1.0)]
        assert samples[f"vllm:request_{name}_seconds_sum"] == [({"model_name": "m"}, value)]
    assert "vllm:lora_requests_info" not in _scrape(ServerMetrics("m", EngineStats, prefix="vllm").render().decode())


def test_scheduler_reports_lora_adapters_and_steps():
    from scheduler_helpers import make_request

    from halserve.lora.request import LoRARequest
    from halserve.scheduler import Scheduler, SchedulerConfig
    from halserve.scheduler_output import ModelRunnerOutput

    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=8,
                                      num_blocks=16, max_loras=1))
    for req_id, lora in (("a", LoRARequest("ada", 1, "/ada")), ("b", LoRARequest("bea", 2, "/bea")), ("c", None)):
        request = make_request(req_id, range(5), max_tokens=2)
        request.lora_request = lora
        sched.add_request(request)
    so = sched.schedule()  # (one adapter per batch: "bea" waits)
    stats = sched.get_stats()
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters, stats.max_loras) == (("ada",), ("bea",), 1)
    ids = list(so.num_scheduled_tokens)
    sched.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[9]] * len(ids), logprobs=[None] * len(ids)))
    stats = sched.get_stats()
    assert stats.iteration_tokens_sum == so.total_num_scheduled_tokens == 10
    assert stats.iteration_tokens_counts[2] == 1 and sum(stats.iteration_tokens_counts) == 1  # 10 tokens: le 16

"""Observability (issue 30 item 4, issue 29's per-group metric): OpenTelemetry spans received by an
OTLP/HTTP receiver the tests start, one request-log line per request, the per-phase and per-step
histograms, the LoRA info gauge, and the per-KV-cache-group usage gauge against a hand count."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
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


# ---------------------------------------------------------------- issue 29: per-group usage, hand-counted
@pytest.mark.slow
def test_kv_cache_group_usage_matches_a_hand_count(tmp_path, _no_multiprocess):
    """Gemma-3-style layers (3 sliding with an 8-token window : 1 full, one KV-cache group each), 4-token
    blocks: after each step of a 100-token prompt the engine's per-group usage, and the /metrics gauge
    rendered from it, are the blocks each group must hold over the pool's usable blocks: a sliding group
    ceil(n / 4) - (n - 8) // 4 (the window), the full group ceil(n / 4)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models"))
    from test_gemma import make_gemma_checkpoint

    from halserve import LLM
    from halserve.kv_cache.spec import cdiv

    block_size, window = 4, 8
    path = make_gemma_checkpoint(tmp_path, 3, num_hidden_layers=4, sliding_window=window,
                                 layer_types=["sliding_attention"] * 3 + ["full_attention"])
    llm = LLM(path, platform="cpu", dtype="float32", block_size=block_size, max_num_batched_tokens=128,
              max_model_len=256, num_kv_blocks=200)
    core = llm.llm_engine.core
    sched, usable = core.scheduler, core.scheduler.kv_cache_manager.num_usable_blocks
    update, seen = sched.update_from_output, []

    def recorded(so, out):
        result = update(so, out)
        seen.append(([r.num_computed_tokens for r in sched.running], core.get_stats()))
        return result

    sched.update_from_output = recorded
    (out,) = llm.generate([{"prompt_token_ids": [1] + [(7 * i) % 500 + 3 for i in range(99)]}],
                          SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    m = out.metrics  # (the offline API's RequestOutput.metrics: the phases' time stamps, in order)
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert len(seen) == 12
    for computed, stats in seen[1:-1]:  # (the first step holds the whole prompt; after the last one, nothing)
        (n,) = computed
        by_hand = [cdiv(n, block_size) - (n - window) // block_size] * 3 + [cdiv(n, block_size)]
        assert stats.kv_cache_group_kinds == ("sliding_window",) * 3 + ("full_attention",)
        assert stats.kv_cache_group_usage == pytest.approx([b / usable for b in by_hand]), (n, by_hand)
        assert sum(stats.kv_cache_group_usage) == pytest.approx(stats.kv_cache_usage)
        gauge = _scrape(ServerMetrics("g", lambda s=stats: s).render().decode())["halserve:kv_cache_group_usage_perc"]
        assert sorted((int(labels["kv_cache_group"]), labels["kind"], value) for labels, value in gauge) == [
            (g, kind, pytest.approx(b / usable)) for g, (kind, b) in enumerate(zip(stats.kv_cache_group_kinds, by_hand))]
    first_n, first = seen[0]
    assert first.kv_cache_group_usage == pytest.approx([25 / usable] * 4) and first_n == [100]


# ---------------------------------------------------------------- a served model, two API servers
@pytest.mark.slow
def test_served_requests_are_traced_logged_and_measured(checkpoint, receiver, tmp_path):
    """``--api-server-count 2`` (engine core in its own process; the servers' per-request histograms summed
    over both): three sequential completions of 4 tokens each reach the OTLP receiver as three spans (the
    one sent with a traceparent in the caller's trace), the log has exactly one request line per request,
    and /metrics counts three requests in each phase and the engine's steps: one prefill and three decode
    steps per request, prompt + 3 tokens each."""
    from server_utils import SERVED_NAME, ServerProcess, server_args

    args = server_args(checkpoint, "--api-server-count", "2", "--enable-log-requests", "--log-request-prompts",
                       "--otlp-traces-endpoint", receiver.url)
    srv = ServerProcess(args, str(tmp_path / "server.log"), env={"OTEL_BSP_SCHEDULE_DELAY": "50"}).wait_ready()
    try:
        usages = {}
        for i, prompt in enumerate(["the quick brown fox", "hello world again and again", "one two"]):
            headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"} if i == 0 else {}
            reply = httpx.post(srv.url + "/v1/completions", headers=headers, timeout=60, json={
                "model": SERVED_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
            assert reply.status_code == 200, reply.text
            usages[reply.json()["id"]] = (prompt, reply.json()["usage"])
        spans = receiver.wait_spans(3)
        deadline = time.monotonic() + 10
        while True:  # (the engine's snapshot of its last step may lag the last reply a moment)
            samples = _scrape(httpx.get(srv.url + "/metrics", timeout=10).text)
            if samples["halserve:iteration_tokens_total_count"][0][1] >= 12 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        srv.stop()
    assert all(u["completion_tokens"] == 4 for _, u in usages.values())
    num_prompt_tokens = sum(u["prompt_tokens"] for _, u in usages.values())
    # spans: one per request, vLLM's name and attributes
    assert len(spans) == 3 and {s.name for s in spans} == {"llm_request"}
    by_id = {}
    for span in spans:
        attrs = attributes(span)
        request_id = attrs["gen_ai.request.id"]
        assert request_id.startswith("cmpl-") and request_id not in by_id
        by_id[request_id] = span
        assert attrs["gen_ai.usage.completion_tokens"] == 4 and attrs["gen_ai.request.max_tokens"] == 4
        assert attrs["gen_ai.request.temperature"] == 0.0 and attrs["gen_ai.request.n"] == 1
        queue, prefill, decode = (attrs[f"gen_ai.latency.{k}"] for k in ("time_in_queue", "time_in_model_prefill",
                                                                            "time_in_model_decode"))
        assert attrs["gen_ai.latency.time_in_model_inference"] == pytest.approx(prefill + decode)
        assert 0 <= queue + prefill <= attrs["gen_ai.latency.time_to_first_token"] + 1e-6
        assert attrs["gen_ai.latency.time_to_first_token"] <= attrs["gen_ai.latency.e2e"]
    traced = [s for s in spans if s.trace_id.hex() == TRACE_ID]
    assert len(traced) == 1 and traced[0].parent_span_id.hex() == PARENT_SPAN_ID
    # the log: one line per request, matching the replies' usage
    lines = [line.split("halserve.requests: request ", 1)[1] for line in srv.log().splitlines()
             if "halserve.requests: request " in line]
    records = {r["id"]: r for r in map(json.loads, lines)}
    assert len(lines) == 3 and set(records) == set(usages) == {attributes(s)["gen_ai.request.id"] for s in spans}
    for request_id, (prompt, usage) in usages.items():
        r = records[request_id]
        assert (r["model"], r["prompt"], r["prompt_tokens"], r["generated_tokens"], r["finish_reason"]) == (
            SERVED_NAME, prompt, usage["prompt_tokens"], 4, "length")
        assert r["e2e_s"] >= r["ttft_s"] >= r["queue_s"] >= 0 and r["decode_s"] >= 0
        assert attributes(by_id[request_id])["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    # /metrics: three requests in each phase (whichever server answered), the engine's steps
    for phase in ("queue", "prefill", "decode", "inference"):
        assert samples[f"halserve:request_{phase}_time_seconds_count"] == [({"model_name": SERVED_NAME}, 3.0)]
    assert samples["halserve:iteration_tokens_total_count"][0][1] == 3 * 4
    assert samples["halserve:iteration_tokens_total_sum"][0][1] == num_prompt_tokens + 3 * 3


# ---------------------------------------------------------------- the offline API
def test_offline_tracing_checks_the_endpoint_before_loading_the_model():
    from halserve import LLM

    with pytest.raises(ValueError, match=r"otlp_traces_endpoint= 'grpc://localhost:4317': give the OTLP/HTTP URL"):
        LLM("no/such/checkpoint", otlp_traces_endpoint="grpc://localhost:4317")


@pytest.mark.slow
def test_offline_llm_sends_the_servers_spans(checkpoint, receiver):
    """``LLM(otlp_traces_endpoint=...)``: one ``llm_request`` span per finished request, with the server's
    attributes, its start and end at the request's arrival and finish (RequestOutput.metrics), and the
    ones still queued exported at shutdown."""
    from halserve import LLM

    llm = LLM(checkpoint, platform="cpu", dtype="float32", num_kv_blocks=64, max_model_len=128,
              otlp_traces_endpoint=receiver.url)
    sampled = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=5, max_tokens=4, ignore_eos=True, seed=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    try:
        outs = llm.generate(["the quick brown fox", {"prompt_token_ids": [5, 6, 7, 8, 9]}], [sampled, greedy],
                            use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()  # (exports what the batch processor still holds)
    spans = {attributes(s)["gen_ai.request.id"]: s for s in receiver.wait_spans(2, timeout=5)}
    assert len(receiver.spans()) == 2 and set(spans) == {out.request_id for out in outs}
    for out, params in zip(outs, (sampled, greedy)):
        span, m = spans[out.request_id], out.metrics
        attrs = attributes(span)
        assert span.name == "llm_request" and span.kind == 2  # SPAN_KIND_SERVER
        assert (span.start_time_unix_nano, span.end_time_unix_nano) == (int(m.arrival_time * 1e9),
                                                                         int(m.finished_time * 1e9))
        assert attrs["gen_ai.response.model"] == checkpoint
        assert attrs["gen_ai.response.finish_reasons"] == ["length"]
        assert attrs["gen_ai.usage.prompt_tokens"] == len(out.prompt_token_ids)
        assert attrs["gen_ai.usage.completion_tokens"] == sum(len(o.token_ids) for o in out.outputs) == \
            params.n * params.max_tokens
        assert (attrs["gen_ai.request.n"], attrs["gen_ai.request.max_tokens"]) == (params.n, params.max_tokens)
        assert attrs["gen_ai.request.temperature"] == params.temperature
        queue, prefill, decode = (attrs[f"gen_ai.latency.{k}"] for k in ("time_in_queue", "time_in_model_prefill",
                                                                            "time_in_model_decode"))
        assert queue == pytest.approx(m.first_scheduled_time - m.arrival_time)
        assert queue + prefill == pytest.approx(attrs["gen_ai.latency.time_to_first_token"])
        assert prefill + decode == pytest.approx(attrs["gen_ai.latency.time_in_model_inference"])
        assert attrs["gen_ai.latency.e2e"] == pytest.approx(m.finished_time - m.arrival_time)
    sampled_attrs = attributes(spans[outs[0].request_id])
    assert (sampled_attrs["gen_ai.request.top_p"], sampled_attrs["gen_ai.request.top_k"]) == (pytest.approx(0.9), 5)

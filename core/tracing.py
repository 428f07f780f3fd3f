"""OpenTelemetry traces of requests (``--otlp-traces-endpoint``, ``LLM(otlp_traces_endpoint=...)``).

One span per request, named and attributed as vLLM's (``llm_request``, kind SERVER, the
``gen_ai.*`` attributes of ``SpanAttributes``), sent over OTLP/HTTP (protobuf) by the
OpenTelemetry SDK's batch processor. A request that arrived with a W3C ``traceparent`` header
gets its span in that trace, as a child of the caller's span.

The HTTP layer puts the incoming trace headers in a context variable (``set_trace_headers``);
``AsyncLLM.submit`` reads them (``current_trace_headers``) into the request's state, and the
``RequestTracer`` (an ``AsyncLLM`` stats observer) writes the span when the request finishes,
with the request's real start and end times. Offline, ``LLM(otlp_traces_endpoint=...)`` gives the
same tracer to its ``LLMEngine``, which reports each request as it finishes in ``step``.

This module imports nothing of OpenTelemetry until a ``RequestTracer`` is made: the SDK is the
optional ``halserve[otel]`` extra, and ``import halserve`` never needs it.
"""
from __future__ import annotations

import contextvars
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from halserve.engine.request_stream import FinishedRequestObserver

if TYPE_CHECKING:  # pragma: no cover
    from halserve.engine.request_stream import FinishedRequestStats

__all__ = ["OTEL_INSTALL_HINT", "TRACE_HEADERS", "RequestTracer", "SpanAttributes", "TraceContextMiddleware",
           "check_otel_installed", "current_trace_headers", "set_trace_headers", "traces_url"]

TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context
OTEL_INSTALL_HINT = ("pip install 'halserve[otel]' (or: pip install opentelemetry-sdk "
                     "opentelemetry-exporter-otlp-proto-http)")
SPAN_NAME = "llm_request"  # vLLM's

_trace_headers: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "halserve_trace_headers", default=None)


class SpanAttributes:
    """vLLM's span attribute names (``vllm/tracing.py``), so dashboards built for vLLM read halserve's."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_CACHED_TOKENS = "gen_ai.usage.cached_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


def current_trace_headers() -> dict[str, str] | None:
    """The trace headers of the HTTP request being handled in this context (None: none came)."""
    return _trace_headers.get()


def set_trace_headers(headers: Mapping[str, str]) -> contextvars.Token | None:
    """Remember ``headers``' W3C trace context for the requests this context submits; the token
    resets it (None: the headers carry no trace context, nothing set)."""
    found = {name: headers[name] for name in TRACE_HEADERS if name in headers}
    return _trace_headers.set(found) if "traceparent" in found else None


def reset_trace_headers(token: contextvars.Token | None) -> None:
    if token is not None:
        _trace_headers.reset(token)


class TraceContextMiddleware:
    """Pure ASGI middleware: an HTTP request's ``traceparent`` / ``tracestate`` headers become the
    trace context (``current_trace_headers``) of the engine requests its handler submits."""

    _names = tuple(name.encode() for name in TRACE_HEADERS)

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        found = {name.decode(): value.decode("latin-1") for name, value in scope.get("headers") or ()
                 if name in self._names}
        token = set_trace_headers(found) if found else None
        try:
            await self.app(scope, receive, send)
        finally:
            reset_trace_headers(token)


def check_otel_installed(option: str = "--otlp-traces-endpoint") -> None:
    """ValueError naming the pip command when the OpenTelemetry SDK or its OTLP/HTTP exporter is missing
    (``option``: how the caller asked for traces)."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"{option} needs the OpenTelemetry SDK and its OTLP/HTTP exporter, "
                         f"which are not installed ({exc}): {OTEL_INSTALL_HINT}") from None


def traces_url(endpoint: str, option: str = "--otlp-traces-endpoint") -> str:
    """The OTLP/HTTP traces URL of ``endpoint``: as given, or with ``/v1/traces`` appended when it
    names only a collector (``http://host:4318``). ValueError for anything but an http(s) URL
    (``option``: how the caller gave it, for the message)."""
    parts = urlsplit(endpoint) if isinstance(endpoint, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{option} {endpoint!r}: give the OTLP/HTTP URL of a collector, e.g. "
                         "http://localhost:4318/v1/traces (halserve exports over HTTP/protobuf, not gRPC)")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class RequestTracer(FinishedRequestObserver):
    """A stats observer (``AsyncLLM``'s, or ``LLMEngine``'s offline) that exports one span per finished request."""

    def __init__(self, endpoint: str, model_name: str, service_name: str = "halserve") -> None:
        url = traces_url(endpoint)
        check_otel_installed()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.endpoint = url
        self.model_name = model_name
        # (a provider of our own, not the global one: several engines or tests in one process keep apart)
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
        self._tracer = self._provider.get_tracer("halserve.engine")
        self._propagator = TraceContextTextMapPropagator()
        self._kind = SpanKind.SERVER

    def on_request_stats(self, stats: FinishedRequestStats) -> None:
        context = self._propagator.extract(stats.trace_headers) if stats.trace_headers else None
        span = self._tracer.start_span(SPAN_NAME, context=context, kind=self._kind,
                                       start_time=_ns(stats.arrival_time))
        for key, value in self.attributes(stats).items():
            span.set_attribute(key, value)
        span.end(end_time=_ns(stats.finished_time))

    def attributes(self, stats: FinishedRequestStats) -> dict[str, Any]:
        """The span's attributes (a phase the request never reached is left out)."""
        a = SpanAttributes
        attrs: dict[str, Any] = {
            a.GEN_AI_REQUEST_ID: stats.request_id,
            a.GEN_AI_RESPONSE_MODEL: stats.lora_name or self.model_name,
            a.GEN_AI_RESPONSE_FINISH_REASONS: [stats.finish_reason],
            a.GEN_AI_USAGE_PROMPT_TOKENS: stats.num_prompt_tokens,
            a.GEN_AI_USAGE_COMPLETION_TOKENS: stats.num_generation_tokens,
            a.GEN_AI_USAGE_CACHED_TOKENS: stats.num_cached_tokens,
            a.GEN_AI_REQUEST_N: stats.n,
            a.GEN_AI_LATENCY_E2E: stats.e2e_time,
        }
        if stats.max_tokens is not None:
            attrs[a.GEN_AI_REQUEST_MAX_TOKENS] = stats.max_tokens
        params = stats.params
        if params is not None:
            for key, value in ((a.GEN_AI_REQUEST_TEMPERATURE, getattr(params, "temperature", None)),
                               (a.GEN_AI_REQUEST_TOP_P, getattr(params, "top_p", None)),
                               (a.GEN_AI_REQUEST_TOP_K, getattr(params, "top_k", None))):
                if value is not None:
                    attrs[key] = value
        for key, value in ((a.GEN_AI_LATENCY_TIME_IN_QUEUE, stats.queue_time),
                           (a.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN, stats.ttft),
                           (a.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL, stats.prefill_time),
                           (a.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE, stats.decode_time),
                           (a.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE, stats.inference_time)):
            if value is not None:
                attrs[key] = value
        return attrs

    def shutdown(self) -> None:
        """Export what is still queued and stop (the server's exit)."""
        self._provider.shutdown()

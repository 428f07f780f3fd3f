"""vLLM's ``serve`` flags that halserve accepts, so an existing vLLM launch line starts halserve.

Each flag either does what it does in vLLM or, where the feature has no meaning here, is accepted
and logs one line saying why it changes nothing. A flag halserve does not know is still an error,
one that names the nearest halserve flag (``unrecognized_message``).

    vLLM flag                         halserve
    --gpu-memory-utilization F        EngineConfig.gpu_memory_utilization (share of *total* device memory)
    --[no-]enable-chunked-prefill     EngineConfig.enable_chunked_prefill
    --generation-config auto|vllm|DIR EngineConfig.generation_config
    --max-logprobs N                  EngineConfig.max_logprobs
    --scheduling-policy fcfs|priority EngineConfig.scheduling_policy (a flag of halserve serve's scheduler group)
    --model MODEL                     the MODEL argument
    --enable-log-requests             one JSON log line per finished request (entrypoints/request_logger.py);
                                      prompts only with --log-request-prompts (halserve's), cut to --max-log-len
    --otlp-traces-endpoint URL        an OpenTelemetry span per request, over OTLP/HTTP (halserve.tracing)
    --disable-log-requests, --disable-log-stats,
    --swap-space, --disable-custom-all-reduce   accepted; one log line each (NO_EFFECT)
    (--trust-remote-code, --enforce-eager, --disable-frontend-multiprocessing, ... are halserve's own flags)
"""
from __future__ import annotations

import argparse
import difflib
import logging
from typing import Any

__all__ = ["NO_EFFECT", "SuggestingArgumentParser", "VLLM_EQUIVALENTS", "add_vllm_flags", "apply_vllm_flags",
           "config_kwargs", "request_observers", "unrecognized_message"]

logger = logging.getLogger("halserve.serve")

# flag dest -> why the flag changes nothing in halserve (logged once at start-up when given)
NO_EFFECT = {
    "disable_log_requests": "halserve's per-request log lines are off unless --enable-log-requests is given",
    "disable_log_stats": "halserve logs no periodic throughput stats (GET /metrics has them)",
    "swap_space": "halserve preempts by recomputation and never swaps KV blocks to host memory "
                  "(--kv-offloading-size gives the KV cache a host-memory prefix tier)",
    "disable_custom_all_reduce": "halserve's tensor-parallel all-reduce is the platform's communicator; "
                                 "there is no custom all-reduce kernel to turn off",
}

# vLLM flags halserve does not accept -> (the nearest halserve flag or None, why)
VLLM_EQUIVALENTS: dict[str, tuple[str | None, str]] = {
    "--kv-cache-memory-bytes": ("--kv-cache-memory", "the KV cache's size: bytes, or e.g. 4GiB"),
    "--num-gpu-blocks-override": ("--num-kv-blocks", "fix the KV cache at this many blocks"),
    "--uvicorn-log-level": ("--log-level", "one log level for the server and the engine"),
    "--override-generation-config": ("--generation-config", "a folder holding a generation_config.json"),
    "--speculative-model": ("--speculative-config", "'{\"model\": DRAFT, \"num_speculative_tokens\": 4}'"),
    "--num-speculative-tokens": ("--speculative-config", "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'"),
    "--enable-reasoning": ("--reasoning-parser", "naming the parser turns reasoning output on"),
    "--kv-offloading-backend": ("--kv-offloading-size", "the host-memory tier is halserve's OffloadingConnector"),
    "--data-parallel-size": (None, "halserve has no data parallelism: run one server per replica behind a balancer"),
    "--cpu-offload-gb": (None, "halserve does not offload weights to host memory"),
}


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """The vLLM flags halserve's own groups lack, as one argument group of ``halserve serve``."""
    g = parser.add_argument_group(
        "vLLM compatibility", "vLLM's serve flags, so a vLLM launch line runs unchanged; a flag whose feature "
        "halserve lacks logs why it changes nothing")
    g.add_argument("--model", dest="vllm_model", default=None, metavar="MODEL",
                   help="MODEL as a flag (vLLM's older form); give it once, as a flag or as the argument")
    g.add_argument(
        "--gpu-memory-utilization", type=float, default=None, metavar="F",
        help="vLLM's meaning: the share (0-1] of the device's *total* memory this server may use for weights, "
        "activations and KV cache; the KV cache gets what the loaded model leaves of it (on the CPU the device "
        "memory is the host's RAM, capped at what is available). Instead of --kv-cache-memory-fraction, which is "
        "a share of *free* memory for the KV cache alone",
    )
    g.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
        help="split long prompts into --max-num-batched-tokens chunks (halserve's default); "
        "--no-enable-chunked-prefill prefills each prompt in one step (--max-num-batched-tokens is raised to "
        "max-model-len)",
    )
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults for what a request leaves unset: auto (the checkpoint's "
                   "generation_config.json), vllm (none: halserve's defaults), or a folder holding one")
    g.add_argument("--max-logprobs", type=int, default=None, metavar="N",
                   help="most logprobs / prompt_logprobs / top_logprobs a request may ask for (default and "
                   "most 20; -1: 20)")
    g.add_argument("--metrics-prefix", default="halserve", choices=["halserve", "vllm"],
                   help="GET /metrics names: halserve:* or vllm:* (vllm also adds the older names vLLM's stock "
                   "Grafana dashboard reads, so it works unchanged)")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="accepted; changes nothing: request logs are off unless --enable-log-requests")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log one line per finished request on the halserve.requests logger: 'request {json}' with "
                   "id, model, lora, token counts, finish_reason and the queue/ttft/prefill/decode/inference/e2e "
                   "times in seconds (no prompt text unless --log-request-prompts)")
    g.add_argument("--log-request-prompts", action="store_true",
                   help="with --enable-log-requests: also log each request's prompt text (it may hold personal "
                   "data; cut to --max-log-len characters)")
    g.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help="with --log-request-prompts: log at most N characters of each prompt (default: whole)")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export an OpenTelemetry span per request (vLLM's name 'llm_request' and gen_ai.* "
                   "attributes) to this OTLP/HTTP collector URL, e.g. http://localhost:4318/v1/traces; a request's "
                   "W3C traceparent header makes its span a child of the caller's (needs: pip install "
                   "'halserve[otel]')")
    g.add_argument("--disable-log-stats", action="store_true", help="accepted; changes nothing (see the log)")
    g.add_argument("--swap-space", type=float, default=None, metavar="GIB",
                   help="accepted; changes nothing: halserve preempts by recomputation (see the log)")
    g.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="accepted; changes nothing (see the log)")


def apply_vllm_flags(args: argparse.Namespace) -> None:
    """Fold ``--model`` into MODEL, check the request-log and tracing flags (the OpenTelemetry SDK
    installed), and log one line per given flag that changes nothing here. ValueError for
    contradictions (MODEL twice, --log-request-prompts without --enable-log-requests, ...)."""
    if args.vllm_model is not None:
        if args.model is not None and args.model != args.vllm_model:
            raise ValueError(f"MODEL given twice: {args.model!r} as the argument and {args.vllm_model!r} as --model; "
                             "give one")
        args.model = args.vllm_model
    if getattr(args, "log_request_prompts", False) and not args.enable_log_requests:
        raise ValueError("--log-request-prompts needs --enable-log-requests (the request log it adds prompts to)")
    if getattr(args, "max_log_len", None) is not None:
        if args.max_log_len < 0:
            raise ValueError(f"--max-log-len {args.max_log_len}: must be >= 0 (characters of each logged prompt)")
        if not args.log_request_prompts:
            raise ValueError("--max-log-len needs --log-request-prompts (it cuts the prompts that flag logs)")
    if getattr(args, "otlp_traces_endpoint", None) is not None:
        from halserve.tracing import check_otel_installed, traces_url

        traces_url(args.otlp_traces_endpoint)
        check_otel_installed()
    for dest, why in NO_EFFECT.items():
        value = getattr(args, dest, None)
        if value not in (None, False):
            flag = "--" + dest.replace("_", "-")
            logger.info("%s changes nothing in halserve: %s", flag, why)


def request_observers(args: argparse.Namespace, model_name: str) -> list[Any]:
    """The ``AsyncLLM`` stats observers the request-log and tracing flags ask for (each has a
    ``shutdown()`` when it must flush at exit)."""
    observers: list[Any] = []
    if getattr(args, "enable_log_requests", False):
        from halserve.entrypoints.request_logger import RequestLogger

        observers.append(RequestLogger(model_name, log_prompts=args.log_request_prompts,
                                       max_prompt_chars=args.max_log_len))
    if getattr(args, "otlp_traces_endpoint", None) is not None:
        from halserve.tracing import RequestTracer

        observers.append(RequestTracer(args.otlp_traces_endpoint, model_name))
    return observers


def config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineConfig`` fields the vLLM flags set (only those given, so the config's own checks --
    e.g. --gpu-memory-utilization with --kv-cache-memory-fraction -- see what the user asked for)."""
    kwargs: dict[str, Any] = {"generation_config": args.generation_config}
    for dest in ("gpu_memory_utilization", "enable_chunked_prefill", "max_logprobs", "kv_cache_memory_fraction"):
        value = getattr(args, dest, None)
        if value is not None:
            kwargs[dest] = value
    return kwargs


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [s for action in parser._actions for s in action.option_strings if s.startswith("--")]


def unrecognized_message(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """argparse's "unrecognized arguments" error, with the nearest halserve flag for each unknown flag."""
    options = _option_strings(parser)
    lines = [f"unrecognized arguments: {' '.join(extras)}"]
    for arg in extras:
        if not arg.startswith("-") or arg[1:2].isdigit():
            continue  # an unknown flag's value, or a stray argument
        flag = arg.split("=", 1)[0]
        nearest, why = VLLM_EQUIVALENTS.get(flag, (None, ""))
        if nearest is None and not why:
            close = difflib.get_close_matches(flag, options, n=1, cutoff=0.6)
            nearest = close[0] if close else None
        if nearest is not None:
            lines.append(f"  {flag}: the nearest halserve flag is {nearest}" + (f" ({why})" if why else ""))
        elif why:
            lines.append(f"  {flag}: not supported: {why}")
        else:
            lines.append(f"  {flag}: no similar halserve flag; see {parser.prog} --help")
    return "\n".join(lines)


class SuggestingArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose "unrecognized arguments" error names the nearest known flag, reported
    by the subcommand's parser (its usage line) when a subcommand was chosen.

    Flags must be spelt out: argparse's prefix matching is off (``allow_abbrev=False``), so a
    misspelt vLLM flag such as ``--max-num-seq`` is an error naming ``--max-num-seqs`` instead of
    silently meaning it (subcommand parsers are made with this class, so they inherit it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._chosen_subparser(parsed) or self
            parser.error(unrecognized_message(extras, parser))
        return parsed

    def _chosen_subparser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser | None:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(getattr(parsed, action.dest, None) or "")
        return None

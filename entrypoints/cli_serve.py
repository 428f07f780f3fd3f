"""``halserve serve [MODEL]``: the OpenAI-compatible server (vLLM's flag names).

Startup order keeps failures fast and loud: flags are validated, then the platform is
selected (an unavailable one fails in seconds with its probe's reason), then flags whose
feature is not available here are rejected (exit code 2), and only then is the model
loaded. Nothing is silently ignored.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig
    from halserve.engine.async_llm import AsyncLLM
    from halserve.platforms.base import Platform

logger = logging.getLogger("halserve.serve")

EXIT_USAGE = 2  # bad or unsupported flags (argparse's code)
EXIT_FAILURE = 1  # the platform is unavailable, the model cannot load, ...

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"4GiB"``, ``"512M"``, ``"1073741824"`` -> bytes (K/M/G/T are powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use bytes or a number with K, M, G or T (e.g. 4GiB)")
    value, unit = float(match.group(1)), match.group(2).lower()
    return int(value * 1024 ** " kmgt".index(unit or " "))


def parse_pooler_config(text: str) -> Any:
    """``'{"pooling_type": "MEAN", "normalize": false}'`` -> PoolerConfig (vLLM's --pooler-config)."""
    from halserve.pooler_config import PoolerConfig

    try:
        return PoolerConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parse_json_config(parse: Any, text: str) -> Any:
    """``parse(text)`` (a pydantic config's ``parse``), its errors as argparse's, one line each field."""
    from pydantic import ValidationError

    try:
        return parse(text)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'value'}: {e['msg']}"
                             for e in exc.errors(include_url=False))
        raise argparse.ArgumentTypeError(problems) from None
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_speculative_config(text: str) -> Any:
    """``'{"method": "ngram", "num_speculative_tokens": 4}'`` -> SpeculativeConfig (vLLM's --speculative-config)."""
    from halserve.spec_decode.config import SpeculativeConfig

    return _parse_json_config(SpeculativeConfig.parse, text)


def parse_kv_transfer_config(text: str) -> Any:
    """``'{"kv_connector": "SharedStorageConnector", ...}'`` -> KVTransferConfig (vLLM's --kv-transfer-config)."""
    from halserve.kv_connectors.base import KVTransferConfig

    return _parse_json_config(KVTransferConfig.parse, text)


def parse_lora_module(text: str) -> Any:
    """``name=path`` or vLLM's JSON form -> LoRAModulePath (one --lora-modules entry)."""
    from halserve.entrypoints.openai.serving_lora import LoRAModulePath

    try:
        return LoRAModulePath.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _CoreCalls:
    """``core.add_lora(...)`` for ``register_static_loras``, wherever the core runs."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def add_lora(self, lora: Any) -> bool:
        return self.client.call_sync("add_lora", lora)


def load_lora_modules(args: argparse.Namespace, engine: AsyncLLM, served: list[str]) -> Any:
    """The served adapters, each loaded and validated now (ValueError: the engine is shut down)."""
    from halserve.entrypoints.openai.serving_lora import LoRAModules, register_static_loras, runtime_updating_from_env

    modules = LoRAModules(allow_runtime_updates=args.enable_lora and (
        args.allow_runtime_lora_updating or runtime_updating_from_env()), shared=engine.client)
    try:
        register_static_loras(_CoreCalls(engine.client), modules, list(args.lora_modules or []), served)
    except BaseException:
        engine.client.close_sync()
        raise
    return modules


class _HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default unless its help already says it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return text
        return text + " (default: %(default)s)"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from halserve.attention_backends.base import KV_CACHE_DTYPES
    from halserve.config import DTYPES

    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /tokenize, /detokenize, /health, /metrics, /version). Without MODEL, serves the bundled "
        "demo model (halserve-demo-adder: completes '123+456=' with '579').",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("model", nargs="?", default=None, metavar="MODEL", help="local HF directory or hub id (default: the demo model)")

    g = p.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0", help="address to bind (0.0.0.0: all interfaces)")
    g.add_argument("--port", type=int, default=8000, help="port to bind")
    g.add_argument(
        "--api-key", nargs="+", action="extend", default=None, metavar="KEY",
        help="require 'Authorization: Bearer KEY' (any of the keys; also HALSERVE_API_KEY); "
        "/health, /metrics and /version stay open",
    )
    g.add_argument(
        "--served-model-name", nargs="+", action="extend", default=None, metavar="NAME",
        help="model name(s) clients use (default: MODEL as given, or halserve-demo-adder)",
    )
    g.add_argument("--chat-template", default=None, metavar="FILE", help="Jinja chat template file (default: the tokenizer's)")
    g.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help="let tool_choice 'auto' (the default with tools) return the calls the model writes, found by "
        "--tool-call-parser",
    )
    g.add_argument(
        "--tool-call-parser", default=None, metavar="NAME",
        help="the model's tool-call format: hermes (<tool_call>{...}</tool_call>: Hermes, Qwen2.5, Qwen3), "
        "llama3_json (Llama 3.1-3.3), mistral ([TOOL_CALLS]), pythonic ([f(x=1)]: Llama 3.2/4), qwen3_coder "
        "(<function=f><parameter=x>: Qwen3-Coder), deepseek_v3 (DeepSeek-V3/R1/V3.1), or one a plugin adds",
    )
    g.add_argument(
        "--tool-parser-plugin", default=None, metavar="FILE",
        help="a Python file that registers tool-call parsers (@register_tool_parser on a "
        "halserve.entrypoints.openai.tool_parsers.ToolParser subclass), for --tool-call-parser",
    )
    g.add_argument(
        "--max-request-body-size", type=parse_bytes, default=32 * 2**20, metavar="BYTES",
        help="larger request bodies get a 413 (default 32MiB)",
    )
    g.add_argument(
        "--allowed-local-media-path", default=None, metavar="DIR",
        help="let requests name images as file:// URLs of files inside DIR (default: file:// URLs are refused)",
    )
    g.add_argument(
        "--allowed-media-domains", nargs="+", default=None, metavar="HOST",
        help="only fetch http(s) image URLs (and their redirects) from these hosts (default: any host)",
    )
    g.add_argument(
        "--limit-mm-per-prompt", default=None, metavar="JSON",
        help="a vision-language model's most images per request, e.g. '{\"image\": 4}' ('{\"image\": 0}' refuses "
        "images; default 64)",
    )
    g.add_argument(
        "--mm-processor-kwargs", default=None, metavar="JSON",
        help="override the checkpoint's image-processor settings, e.g. '{\"max_pixels\": 802816}' (Qwen2-VL)",
    )
    g.add_argument(
        "--reasoning-parser", default=None, metavar="NAME",
        help="a thinking model's <think>...</think> goes to the chat message's 'reasoning' field: deepseek_r1 "
        "(DeepSeek-R1, QwQ: always thinks), qwen3 (Qwen3: thinks unless enable_thinking is false), or one a "
        "plugin adds (halserve_reasoning_parsers)",
    )
    g.add_argument(
        "--enable-prompt-tokens-details", action="store_true",
        help="usage reports prompt_tokens_details.cached_tokens: prompt tokens found in the prefix cache or "
        "loaded by a KV connector",
    )
    g.add_argument(
        "--enable-sleep-mode", action="store_true",
        help="vLLM's sleep mode: POST /sleep?level=1|2 hands the KV cache (1) or the weights and KV cache (2) "
        "back to the OS or the device, POST /wake_up takes them back, GET /is_sleeping, POST /reset_prefix_cache "
        "and POST /update_weights {\"path\": CHECKPOINT} (without the flag these routes do not exist)",
    )
    g.add_argument(
        "--disable-frontend-multiprocessing", action="store_true",
        help="run the engine core (scheduler, KV cache, executor) as a thread of the API-server process "
        "instead of a process of its own",
    )
    g.add_argument(
        "--api-server-count", type=int, default=1, metavar="N",
        help="API-server processes sharing the port, all talking to the one engine-core process",
    )
    g.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"], help="log level"
    )

    g = p.add_argument_group("model")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer directory, hub id or GGUF file (default: MODEL's; a GGUF's from its metadata)")
    g.add_argument("--hf-config-path", default=None,
                   help="directory or hub id of a config.json to use instead of MODEL's (a GGUF's: its metadata)")
    g.add_argument("--revision", default=None, help="model revision (hub branch, tag or commit)")
    g.add_argument("--dtype", default="auto", help=f"model dtype: {', '.join(DTYPES)} (or half, bf16, ...)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--quantization", "-q", default=None, help="quantization method (default: the checkpoint's, if any)")
    g.add_argument("--trust-remote-code", action="store_true", help="allow custom code from the model repository")
    g.add_argument("--seed", type=int, default=0, help="random seed")
    g.add_argument(
        "--pooler-config", "--override-pooler-config", type=parse_pooler_config, default=None, metavar="JSON",
        help="embeddings: pooling_type (LAST, MEAN, CLS) and/or normalize, e.g. "
        "'{\"pooling_type\": \"MEAN\", \"normalize\": false}' (default: the checkpoint's sentence-transformers "
        "config, else LAST and normalized; --override-pooler-config is vLLM's older name)",
    )

    g = p.add_argument_group("platform and parallelism")
    g.add_argument("--platform", default=None, help="platform plugin, e.g. cpu, cuda, rocm (default: HALSERVE_PLATFORM or auto-detect)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks to shard the model over")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="pipeline stages to split the decoder layers over (each --tensor-parallel-size ranks wide)")
    g.add_argument(
        "--distributed-executor-backend", default=None,
        help="executor plugin: uni, mp, ray (default: uni for one rank, mp for more)",
    )
    g.add_argument("--attention-backend", default=None, help="force an attention backend by name (default: the platform's choice)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly: no graphs captured even where the platform offers them")
    g.add_argument("--async-scheduling", action="store_true",
                   help="schedule the next step while this one runs (same outputs; features that cannot yet "
                   "say so at start-up and run synchronously)")
    g.add_argument("--max-cudagraph-capture-size", type=int, default=None, metavar="N",
                   help="largest decode batch captured as a graph (default: min(max-num-seqs, 512))")
    g.add_argument("--load-format", default="auto", metavar="NAME",
                   help="auto | safetensors | dummy (random weights of the model's shapes, no checkpoint read: "
                   "benchmarks) | a plugin's format (halserve_load_formats; `halserve plugins` lists them)")
    g.add_argument("--model-impl", default="auto", choices=["auto", "halserve", "transformers"],
                   help="which code runs the model: halserve (native), transformers (transformers' modeling "
                   "code with halserve's paged attention), auto (native when registered, else transformers)")

    g = p.add_argument_group("scheduler and KV cache")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests in a batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    g.add_argument("--block-size", type=int, default=16, help="KV-cache block size (tokens, a power of two)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="fix the KV cache at this many blocks")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs: arrival order (a request's priority must be 0); priority: by each request's "
                   "priority field (lower first, then arrival), preempting lower priorities for a higher one "
                   "that lacks room (vLLM's)")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None, metavar="BYTES", help="KV-cache size, e.g. 2GiB (default: sized from free memory)")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=None,
                   help="share of free memory the KV cache may take when sized automatically (default 0.9; "
                   "vLLM's --gpu-memory-utilization is a share of total memory instead)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV-cache storage dtype; auto: the model's dtype (a GGUF model kept quantized and computed "
                        "in float32: float16, llama.cpp's default)")
    g.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="reuse the KV cache of shared prompt prefixes",
    )
    g.add_argument(
        "--speculative-config", type=parse_speculative_config, default=None, metavar="JSON",
        help="speculative decoding, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 1}' (prompt-lookup drafts) or '{\"model\": DRAFT, "
        "\"num_speculative_tokens\": 4}' (a draft model of the same vocabulary); drafts are checked in one forward",
    )

    g.add_argument(
        "--kv-transfer-config", type=parse_kv_transfer_config, default=None, metavar="JSON",
        help="a KV connector, e.g. '{\"kv_connector\": \"SharedStorageConnector\", \"kv_role\": \"kv_both\", "
        "\"kv_connector_extra_config\": {\"shared_storage_path\": \"/mnt/kv\"}}' (prompt K/V shared through a "
        "directory) or OffloadingConnector with cpu_bytes_to_use (a host-memory prefix-cache tier)",
    )
    g.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                   help="GiB of host memory for a second prefix-cache tier (the OffloadingConnector)")

    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT format) by name")
    g.add_argument(
        "--lora-modules", nargs="+", action="extend", default=None, type=parse_lora_module, metavar="NAME=PATH",
        help="adapters served as models: name=path, or JSON '{\"name\": ..., \"path\": ..., "
        "\"base_model_name\": ...}'",
    )
    g.add_argument("--max-loras", type=int, default=1, help="most distinct adapters running at once")
    g.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank r accepted")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept loaded (default: max(--max-loras, 8))")
    g.add_argument(
        "--allow-runtime-lora-updating", action="store_true",
        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
        "(also VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
    )
    from halserve.entrypoints.vllm_flags import add_vllm_flags

    add_vllm_flags(p)
    p.set_defaults(func=run)
    return p


class StartupError(Exception):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def resolve_model(args: argparse.Namespace) -> tuple[str, list[str]]:
    """(model path or id, served names)."""
    if args.model is None:
        from halserve.demo import DEMO_MODEL_NAME, DEMO_MODEL_PATH

        return DEMO_MODEL_PATH, args.served_model_name or [DEMO_MODEL_NAME]
    return args.model, args.served_model_name or [args.model]


def build_config(args: argparse.Namespace, model: str) -> Any:
    from pydantic import ValidationError

    from halserve.config import EngineConfig
    from halserve.entrypoints import vllm_flags

    try:
        return EngineConfig(
            model=model,
            tokenizer=args.tokenizer,
            hf_config_path=args.hf_config_path,
            revision=args.revision,
            platform=args.platform,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory=args.kv_cache_memory,
            enable_prefix_caching=args.enable_prefix_caching,
            seed=args.seed,
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            distributed_executor_backend=args.distributed_executor_backend,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            attention_backend=args.attention_backend,
            enforce_eager=args.enforce_eager,
            async_scheduling=args.async_scheduling,
            scheduling_policy=args.scheduling_policy,
            max_cudagraph_capture_size=args.max_cudagraph_capture_size,
            load_format=args.load_format,
            model_impl=args.model_impl,
            trust_remote_code=args.trust_remote_code,
            pooler_config=args.pooler_config,
            enable_lora=args.enable_lora,
            enable_sleep_mode=args.enable_sleep_mode,
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            max_cpu_loras=args.max_cpu_loras,
            speculative_config=args.speculative_config,
            kv_transfer_config=args.kv_transfer_config,
            kv_offloading_size=args.kv_offloading_size,
            limit_mm_per_prompt=args.limit_mm_per_prompt,
            mm_processor_kwargs=args.mm_processor_kwargs,
            **vllm_flags.config_kwargs(args),
        )
    except ValidationError as exc:
        lines = []
        for err in exc.errors(include_url=False):
            msg = str(err["msg"]).removeprefix("Value error, ")
            if err["loc"]:
                lines.append("--" + "-".join(str(x) for x in err["loc"]).replace("_", "-") + f": {msg}")
            else:  # (a check across several flags: its message names them)
                lines.append(msg)
        raise StartupError("invalid flags:\n  " + "\n  ".join(lines), EXIT_USAGE) from None


def check_features(config: EngineConfig, platform: Platform) -> list[str]:
    """Reasons why flags ask for something not available here (empty: all fine)."""
    from halserve.plugins import get_plugin_manager

    manager = get_plugin_manager()
    problems = []
    executor = config.executor_name
    if executor not in manager.executors:
        why = (
            f"--tensor-parallel-size {config.tensor_parallel_size} --pipeline-parallel-size "
            f"{config.pipeline_parallel_size} needs the {executor!r} executor"
            if config.distributed_executor_backend is None
            else f"--distributed-executor-backend {executor}: no such executor"
        )
        problems.append(f"{why}, which is not registered (registered executors: {', '.join(manager.executors.names()) or 'none'})")
    from halserve.models.loader import QUANTIZATION_ALIASES

    quantization = QUANTIZATION_ALIASES.get(config.quantization, config.quantization)
    if quantization is not None and quantization not in manager.quant_methods:
        problems.append(
            f"--quantization {config.quantization}: no quantization method of that name is registered "
            f"(registered: {', '.join(manager.quant_methods.names()) or 'none'})"
        )
    if config.kv_transfer_config is not None:
        from halserve.kv_connectors import check_kv_transfer

        try:
            check_kv_transfer(config)
        except ValueError as exc:
            problems.append(f"--kv-transfer-config: {exc}")
    backends = [
        reg.obj for reg in manager.attention_backends
        if reg.obj.runs_on(platform.name)
        and (config.attention_backend is None or reg.name == config.attention_backend)
    ]
    if config.attention_backend is not None and not backends:
        problems.append(
            f"--attention-backend {config.attention_backend}: no attention backend of that name runs on "
            f"platform {platform.name!r} (registered: {', '.join(manager.attention_backends.names()) or 'none'})"
        )
    elif config.kv_cache_dtype != "auto":
        if not any(config.kv_cache_dtype in b.kv_cache_dtypes for b in backends):
            problems.append(
                f"--kv-cache-dtype {config.kv_cache_dtype}: no attention backend for platform {platform.name!r} "
                f"supports it ({', '.join(f'{b.name}: {list(b.kv_cache_dtypes)}' for b in backends) or 'no backends'})"
            )
    return problems


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file or an inline template (as vLLM accepts), compiled here so a
    broken one stops the start instead of failing every chat request."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            template = f.read()
    elif "{%" in value or "{{" in value:
        template = value
    else:
        raise StartupError(f"--chat-template {value}: no such file", EXIT_USAGE)
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)  # (the environment transformers renders it in)
    except TemplateError as exc:
        where = f" (line {exc.lineno})" if getattr(exc, "lineno", None) else ""
        message = f"--chat-template {value:.80}: not a valid Jinja template: {exc}{where}"
        raise StartupError(message, EXIT_USAGE) from None
    return template


def prepare(args: argparse.Namespace) -> tuple[Any, list[str], str, str | None]:
    """Validate everything cheap: (config, served names, model path, chat template)."""
    from halserve.entrypoints.vllm_flags import apply_vllm_flags
    from halserve.models.model_path import check_local_path
    from halserve.platforms import PlatformUnavailableError, resolve_platform

    try:
        apply_vllm_flags(args)  # (--model into MODEL; a line for each flag that changes nothing here)
    except ValueError as exc:
        raise StartupError(str(exc), EXIT_USAGE) from None
    model, served = resolve_model(args)
    for what, value in (("model", model), ("--tokenizer", args.tokenizer), ("--hf-config-path", args.hf_config_path)):
        if value is not None:  # (a missing local path fails here, not as a hub lookup after start-up)
            try:
                check_local_path(value, what)
            except ValueError as exc:
                raise StartupError(str(exc), EXIT_USAGE) from None
    if not 0 < args.port < 65536:
        raise StartupError(f"--port {args.port}: must be in 1..65535", EXIT_USAGE)
    if args.api_server_count < 1:
        raise StartupError(f"--api-server-count {args.api_server_count}: must be at least 1", EXIT_USAGE)
    if args.api_server_count > 1 and args.disable_frontend_multiprocessing:
        raise StartupError("--api-server-count > 1 needs the engine core in its own process: drop "
                           "--disable-frontend-multiprocessing", EXIT_USAGE)
    config = build_config(args, model)
    chat_template = load_chat_template(args.chat_template)
    if args.allowed_local_media_path is not None and not os.path.isdir(args.allowed_local_media_path):
        raise StartupError(f"--allowed-local-media-path {args.allowed_local_media_path}: no such directory", EXIT_USAGE)
    try:
        platform = resolve_platform(config.platform)
    except PlatformUnavailableError as exc:
        raise StartupError(str(exc), EXIT_FAILURE) from None
    try:
        platform.check_and_update_config(config)
    except ValueError as exc:
        raise StartupError(str(exc), EXIT_USAGE) from None
    problems = check_features(config, platform)
    if (args.lora_modules or args.allow_runtime_lora_updating) and not args.enable_lora:
        flag = "--lora-modules" if args.lora_modules else "--allow-runtime-lora-updating"
        problems.append(f"{flag} needs --enable-lora")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        problems.append("--enable-auto-tool-choice needs --tool-call-parser (the model's tool-call format)")
    problems.extend(check_tool_parser_flags(args))
    if problems:
        raise StartupError("unsupported flags:\n  " + "\n  ".join(problems), EXIT_USAGE)
    return config, served, model, chat_template


def check_tool_parser_flags(args: argparse.Namespace) -> list[str]:
    """Load --tool-parser-plugin (once per process) and check that --tool-call-parser and
    --reasoning-parser name parsers: the problems found."""
    from halserve.entrypoints.openai.tool_parsers import get_tool_parser, load_tool_parser_plugin

    if args.tool_parser_plugin is not None:
        try:
            load_tool_parser_plugin(args.tool_parser_plugin)
        except ValueError as exc:
            return [str(exc)]
    problems = []
    if args.tool_call_parser is not None:
        try:
            get_tool_parser(args.tool_call_parser)
        except (ValueError, TypeError) as exc:
            problems.append(f"--tool-call-parser: {exc}")
    if args.reasoning_parser is not None:
        from halserve.entrypoints.openai.reasoning import get_reasoning_parser

        try:
            get_reasoning_parser(args.reasoning_parser)
        except (ValueError, TypeError) as exc:
            problems.append(f"--reasoning-parser: {exc}")
    return problems


def run(args: argparse.Namespace) -> int:
    try:
        config, served, model, chat_template = prepare(args)
    except StartupError as exc:
        print(f"halserve serve: error: {exc}", file=sys.stderr)
        return exc.exit_code
    if args.api_server_count > 1:
        from halserve.entrypoints.openai.api_server_pool import run_api_servers

        return run_api_servers(args, config, served, model, chat_template)

    from halserve.engine.async_llm import AsyncLLM

    try:
        engine = AsyncLLM.from_config(config, multiprocess=not args.disable_frontend_multiprocessing,
                                      log_level=engine_log_level(args))
        lora_modules = load_lora_modules(args, engine, served)
    except Exception as exc:  # noqa: BLE001 - report and exit, never a traceback wall
        return report_load_failure(exc, model)
    return serve_http(args, engine, served, model, chat_template, lora_modules)


def engine_log_level(args: argparse.Namespace) -> int:
    return getattr(logging, args.log_level.upper(), logging.INFO)


def report_load_failure(exc: Exception, model: str) -> int:
    """Print why the engine could not start; the exit code (2: the flags are at fault)."""
    from halserve.engine.core_client import EngineCoreStartError

    if isinstance(exc, ValueError) or (isinstance(exc, EngineCoreStartError) and exc.is_bad_config):
        print(f"halserve serve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    logger.debug("model loading failed", exc_info=True)
    what = str(exc) if isinstance(exc, EngineCoreStartError) else f"{type(exc).__name__}: {exc}"
    print(f"halserve serve: error: could not load {model}: {what}", file=sys.stderr)
    return EXIT_FAILURE


def serve_http(args: argparse.Namespace, engine: AsyncLLM, served: list[str], model: str, chat_template: str | None,
               lora_modules: Any, sock: Any = None) -> int:
    """Run the HTTP server over ``engine`` until a signal or the engine's death; the exit code.
    ``sock``: an already bound listening socket (one of several API servers)."""
    # Everything loaded so far lives until exit: keep it out of the garbage collector's
    # scans (shorter GC pauses while serving, and a quick exit), as vLLM does.
    import gc

    from halserve.entrypoints.openai.api_server import run_server
    from halserve.entrypoints.openai.metrics import ServerMetrics
    from halserve.entrypoints.openai.serving_engine import OpenAIServing

    gc.collect()
    gc.freeze()
    # `kill -USR1 <pid>` prints every thread's stack (diagnosing a stuck server).
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    check_tool_parser_flags(args)  # (an API server process of --api-server-count loads the plugin file too)
    from halserve.entrypoints.vllm_flags import request_observers

    metrics = ServerMetrics(served[0], engine.get_stats, prefix=args.metrics_prefix)
    engine.stat_observers.append(metrics)
    observers = request_observers(args, served[0])  # (--enable-log-requests, --otlp-traces-endpoint)
    engine.stat_observers.extend(observers)
    serving = OpenAIServing(
        engine, served, model_path=getattr(engine.model_info, "model_path", None) or model,
        chat_template=chat_template, tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        reasoning_parser=args.reasoning_parser, lora_modules=lora_modules,
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=args.allowed_media_domains,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
    )
    api_keys = list(args.api_key or [])
    if not api_keys and os.environ.get("HALSERVE_API_KEY"):
        api_keys = [os.environ["HALSERVE_API_KEY"]]
    try:
        return run_server(serving, metrics, args.host, args.port, api_keys, args.log_level,
                          args.max_request_body_size, sock=sock, enable_sleep_mode=args.enable_sleep_mode)
    finally:
        for observer in observers:  # (the tracer exports the spans still queued)
            if hasattr(observer, "shutdown"):
                observer.shutdown()

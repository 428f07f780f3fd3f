"""``halserve bench throughput``: offline throughput, like vLLM's benchmark_throughput.

Random-token prompts of ``--input-len`` tokens, ``--output-len`` new tokens each with
``ignore_eos`` (so every request generates exactly that many), all submitted at once.
Prints requests/s, output tokens/s and total tokens/s.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="local HF directory or hub id")
    parser.add_argument("--platform", default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", "-q", default=None,
                        help="quantization method (default: the checkpoint's, if any; fp8 quantizes a float one)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False,
        help="off by default: random prompts share nothing, and vLLM's benchmark is run with it off",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    parser.add_argument("--distributed-executor-backend", default=None, help="uni, mp or ray (default: uni for "
                        "one rank, mp for more)")
    parser.add_argument(
        "--speculative-config", default=None, metavar="JSON",
        help="speculative decoding, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'; "
        "the draft acceptance is printed too",
    )
    parser.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                        help="dummy: random weights of the checkpoint's shapes (needs only config.json and a "
                        "tokenizer in --model)")
    parser.add_argument("--enforce-eager", action="store_true", help="no captured graphs (every step eager)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="schedule the next step while this one runs (EngineConfig.async_scheduling)")
    parser.add_argument("--max-cudagraph-capture-size", type=int, default=None,
                        help="largest decode batch captured as a graph (default: min(max-num-seqs, 512))")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="KV-cache storage dtype (auto: the model's; bfloat16; fp8, fp8_e4m3, fp8_e5m2)")
    parser.add_argument("--kv-cache-memory-fraction", type=float, default=0.9,
                        help="share of free memory the KV cache may take")
    parser.add_argument("--output-json", default=None, help="also write the figures to this file")


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    # Avoid the lowest ids, where special tokens usually live.
    low = min(10, vocab_size - 1)
    return rng.integers(low, vocab_size, size=(num_prompts, input_len)).tolist()


def _usage_error(message: str) -> int:
    print(f"halserve bench throughput: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from halserve import LLM, SamplingParams

    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            return _usage_error(f"--{name.replace('_', '-')} must be >= 1")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        return _usage_error("--temperature must be a finite number >= 0 (0 = greedy)")
    if args.output_json:  # checked now, not after the run
        folder = os.path.dirname(os.path.abspath(args.output_json))
        if os.path.isdir(args.output_json) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            return _usage_error(f"--output-json {args.output_json}: cannot write a file there")
    from pydantic import ValidationError

    from halserve.platforms import PlatformUnavailableError

    try:
        llm = _make_llm(LLM, args)
    except ValidationError as exc:  # an engine setting out of range
        return _usage_error("; ".join(f"--{'-'.join(map(str, e['loc'])).replace('_', '-')}: "
                                      f"{str(e['msg']).removeprefix('Value error, ')}" for e in exc.errors()))
    except (ValueError, TypeError, PlatformUnavailableError) as exc:  # a bad model or platform
        return _usage_error(str(exc))
    limit = llm.llm_engine.model_info.max_model_len
    if args.input_len + args.output_len > limit:
        llm.llm_engine.shutdown()
        return _usage_error(f"--input-len {args.input_len} + --output-len {args.output_len} exceed the model's "
                            f"max_model_len {limit}")
    return _measure(llm, args, SamplingParams)


def _make_llm(llm_class: Any, args: argparse.Namespace) -> Any:
    return llm_class(
        args.model,
        platform=args.platform,
        dtype=args.dtype,
        quantization=args.quantization,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
        attention_backend=args.attention_backend,
        speculative_config=args.speculative_config,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        load_format=args.load_format,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        max_cudagraph_capture_size=args.max_cudagraph_capture_size,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        kv_cache_dtype=args.kv_cache_dtype,
    )


def _measure(llm: Any, args: argparse.Namespace, SamplingParams: Any) -> int:  # noqa: N803
    vocab = llm.llm_engine.model_info.vocab_size
    prompts = [{"prompt_token_ids": p} for p in random_prompts(args.num_prompts, args.input_len, vocab, args.seed)]
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True, detokenize=False
    )
    # Warm-up (allocator, thread pools), not timed.
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_in = sum(len(o.prompt_token_ids) for o in outputs)
    result = {
        "elapsed_s": elapsed,
        "num_requests": len(outputs),
        "requests_per_s": len(outputs) / elapsed,
        "output_tokens_per_s": num_out / elapsed,
        "total_tokens_per_s": (num_out + num_in) / elapsed,
        "num_output_tokens": num_out,
        "num_prompt_tokens": num_in,
        "attention_backend": llm.llm_engine.core.executor.collective_rpc("attention_backend_name")[0],
    }
    print(
        f"Throughput: {result['requests_per_s']:.2f} requests/s, "
        f"{result['total_tokens_per_s']:.2f} total tokens/s, "
        f"{result['output_tokens_per_s']:.2f} output tokens/s "
        f"({num_out} output tokens in {elapsed:.2f} s)"
    )
    stats = llm.llm_engine.core.get_stats()
    if stats.spec_num_drafts:  # (counted over the warm-up too)
        result["spec_num_draft_tokens"] = stats.spec_num_draft_tokens
        result["spec_num_accepted_tokens"] = stats.spec_num_accepted_tokens
        result["spec_acceptance_rate"] = stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens
        print(f"Speculative decoding: {stats.spec_num_accepted_tokens} of {stats.spec_num_draft_tokens} draft tokens "
              f"accepted ({result['spec_acceptance_rate']:.1%}) over {stats.spec_num_drafts} drafts, "
              f"{stats.spec_num_accepted_tokens / stats.spec_num_drafts:.2f} accepted per draft")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    llm.llm_engine.shutdown()
    return 0

"""``halserve bench serve``: load-test any OpenAI-compatible server (like ``vllm bench serve``).

Random prompts of ``--random-input-len`` tokens (sent as token ids, which vLLM and
halserve both accept on /v1/completions, or as text decoded from random ids), each asking
for exactly ``--random-output-len`` tokens (``ignore_eos``), streamed. Requests arrive as
a Poisson process at ``--request-rate`` (all at once by default), optionally capped at
``--max-concurrency`` in flight. Reported per request: TTFT (first content chunk), TPOT
((latency - TTFT) / (output tokens - 1)) and ITL (gaps between content chunks); output
tokens come from the final usage chunk (``stream_options.include_usage``), else the
number of content chunks.

With ``--random-images N`` (vLLM's ``random-mm`` dataset) every request is a chat request
(/v1/chat/completions): one user message of N ``image_url`` parts, seeded random PNG data URLs
of ``--random-image-size`` sides (``halserve.bench.random_images``), then the text. Prompt
tokens then come from usage (they include the server's image placeholder tokens).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from halserve.bench.http_stream import StreamingClient
from halserve.bench.random_images import parse_image_size, random_image_urls, warmup_image_urls

__all__ = ["add_args", "run", "RequestResult", "compute_metrics", "format_table", "sample_prompts"]


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0  # tokens (known when sent as ids, else from usage)
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds, send to last byte
    itl: list[float] = field(default_factory=list)  # seconds between content chunks
    text: str = ""
    sent_at: float = 0.0  # time.perf_counter() when the request was sent


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="model name the server serves")
    parser.add_argument(
        "--endpoint", default="auto",
        help="/v1/completions or /v1/chat/completions; auto: /v1/chat/completions with --random-images, "
        "else /v1/completions",
    )
    parser.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    parser.add_argument("--random-input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--random-output-len", type=int, default=128, help="output tokens per request (ignore_eos)")
    parser.add_argument(
        "--random-prompt-format", choices=["token-ids", "text"], default="token-ids",
        help="send prompts as token ids, or as text decoded from random ids (chat always uses text)",
    )
    parser.add_argument(
        "--random-images", type=int, default=0, metavar="N",
        help="image_url parts per request (chat only): seeded random PNG data URLs before the text",
    )
    parser.add_argument(
        "--random-image-size", type=parse_image_size, default=parse_image_size("224x224"), metavar="WxH",
        help="image sides: WxH, or a range LOW-HIGH drawn per side per image (e.g. 200-400)",
    )
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second (Poisson); inf: all at once")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--seed", type=int, default=0, help="random seed for prompts and arrivals")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--tokenizer", default=None, help="tokenizer to draw prompt tokens from (default: --model)")
    parser.add_argument("--result-json", default=None, metavar="FILE", help="also write the results as JSON here")
    parser.add_argument(
        "--save-detailed", action="store_true",
        help="with --result-json: also each request's send time (s after the first), TTFT, inter-token latencies, "
             "prompt and output lengths, text and error (vLLM's keys)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")


# ---------------------------------------------------------------------- prompts
def load_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    if name == "halserve-demo-adder":
        from halserve.demo import DEMO_MODEL_PATH

        name = DEMO_MODEL_PATH
    return AutoTokenizer.from_pretrained(name)


def sample_prompts(tokenizer: Any, num: int, input_len: int, seed: int, as_text: bool) -> list[tuple[Any, int]]:
    """``num`` prompts of ``input_len`` random non-special tokens: (prompt, prompt_len).
    Text prompts are decoded from the ids; their exact length is taken from usage."""
    rng = random.Random(seed)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    # (added special tokens too: a VLM's ``<image>`` is one, and a stray one breaks the request)
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special.update(i for i, token in decoder.items() if getattr(token, "special", False))
    pool = [i for i in range(len(tokenizer)) if i not in special]
    if not pool:
        raise ValueError("the tokenizer has no non-special tokens to build prompts from")
    prompts = []
    for _ in range(num):
        ids = [rng.choice(pool) for _ in range(input_len)]
        prompts.append((tokenizer.decode(ids) if as_text else ids, input_len))
    return prompts


def build_payload(
    endpoint: str, model: str, prompt: Any, output_len: int, image_urls: list[str] | None = None
) -> dict[str, Any]:
    """The streamed request body; chat with ``image_urls``: their ``image_url`` parts, then the text."""
    common = {
        "model": model,
        "temperature": 0.0,
        "max_tokens": output_len,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint.endswith("chat/completions"):
        text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        if not image_urls:
            return {**common, "messages": [{"role": "user", "content": text}]}
        parts = [{"type": "image_url", "image_url": {"url": url}} for url in image_urls]
        return {**common, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]}
    if image_urls:
        raise ValueError(f"images need the chat endpoint (/v1/chat/completions), not {endpoint!r}")
    return {**common, "prompt": prompt}


# ---------------------------------------------------------------------- one request
async def send_request(
    client: StreamingClient, path: str, payload: dict[str, Any], headers: dict[str, str], prompt_len: int,
    timeout: float = 600.0,
) -> RequestResult:
    result = RequestResult(prompt_len=prompt_len)
    try:
        await asyncio.wait_for(_stream(client, path, payload, headers, result), timeout)
    except asyncio.TimeoutError:
        result.success = False
        result.error = f"no complete answer within --timeout {timeout:g} s"
    return result


async def _stream(client: StreamingClient, path: str, payload: dict[str, Any], headers: dict[str, str],
                  result: RequestResult) -> None:
    chunks = 0
    usage_tokens = None
    body = json.dumps(payload).encode()
    start = last = result.sent_at = time.perf_counter()
    try:
        async with client.post(path, body, headers) as response:
            if response.status_code != 200:
                text = (await response.read()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:500]}"
                return
            done = False
            async for line in response.lines():  # read to the body's end, so that the connection is reused
                if done or not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    result.error = str(obj["error"].get("message", obj["error"]))
                    return
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                    result.prompt_len = obj["usage"].get("prompt_tokens") or result.prompt_len
                text = "".join(_chunk_text(c) for c in obj.get("choices") or [])
                if text:
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
                    result.text += text
        result.latency = time.perf_counter() - start
        result.output_tokens = usage_tokens if usage_tokens is not None else chunks
        result.success = True
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point
        result.error = f"{type(exc).__name__}: {exc}"


def _chunk_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


# ---------------------------------------------------------------------- statistics
def _stats(values_s: list[float]) -> dict[str, float]:
    import numpy as np

    if not values_s:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}
    arr = np.asarray(values_s, dtype=float) * 1000.0
    return {
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "std": float(arr.std()),
        "p99": float(np.percentile(arr, 99)),
    }


def compute_metrics(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    metrics: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
    }
    for name, values in (
        ("ttft", [r.ttft for r in ok]),
        ("tpot", tpots),
        ("itl", [x for r in ok for x in r.itl]),
        ("e2el", [r.latency for r in ok]),
    ):
        for stat, value in _stats(values).items():
            metrics[f"{stat}_{name}_ms"] = value
    metrics["errors"] = [r.error for r in results if not r.success][:20]
    return metrics


def detailed(results: list[RequestResult], start: float) -> dict[str, list]:
    """Per-request lists, in send order (``--save-detailed``): seconds, except ``itls`` (seconds too, per request)."""
    return {
        "start_times": [r.sent_at - start for r in results],
        "ttfts": [r.ttft if r.success else None for r in results],
        "itls": [r.itl for r in results],
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "generated_texts": [r.text for r in results],
        "errors": [r.error for r in results],
    }


def format_table(m: dict[str, Any]) -> str:
    rows = [
        "{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
        f"{'Successful requests:':<40}{m['completed']:<10}",
        f"{'Failed requests:':<40}{m['failed']:<10}",
        f"{'Benchmark duration (s):':<40}{m['duration']:<10.2f}",
        f"{'Total input tokens:':<40}{m['total_input_tokens']:<10}",
        f"{'Total generated tokens:':<40}{m['total_output_tokens']:<10}",
        f"{'Request throughput (req/s):':<40}{m['request_throughput']:<10.2f}",
        f"{'Output token throughput (tok/s):':<40}{m['output_throughput']:<10.2f}",
        f"{'Total Token throughput (tok/s):':<40}{m['total_token_throughput']:<10.2f}",
    ]
    for key, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
    ):
        rows.append("{s:{c}^50}".format(s=title, c="-"))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            rows.append(f"{f'{label} {key.upper()} (ms):':<40}{m[f'{stat}_{key}_ms']:<10.2f}")
    rows.append("=" * 50)
    return "\n".join(rows)


# ---------------------------------------------------------------------- the run
async def _arrivals(num: int, rate: float, rng: random.Random):
    for i in range(num):
        yield i
        if rate != float("inf") and i < num - 1:
            await asyncio.sleep(rng.expovariate(rate))


async def benchmark(
    args: argparse.Namespace, prompts: list[tuple[Any, int]], images: list[list[str]], warmup_images: list[str]
) -> dict[str, Any]:
    """``images[i]``: request i's image URLs; ``warmup_images``: the test request's."""
    url = args.base_url.rstrip("/") + args.endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with StreamingClient(args.base_url) as client:
        test_payload = build_payload(args.endpoint, args.model, prompts[0][0], 2, warmup_images)
        test = await send_request(client, args.endpoint, test_payload, headers, prompts[0][1], args.timeout)
        if not test.success:
            raise RuntimeError(f"the test request to {url} failed: {test.error}")
        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def one(i: int) -> RequestResult:
            prompt, prompt_len = prompts[i]
            payload = build_payload(args.endpoint, args.model, prompt, args.random_output_len, images[i])
            if semaphore is None:
                return await send_request(client, args.endpoint, payload, headers, prompt_len, args.timeout)
            async with semaphore:
                return await send_request(client, args.endpoint, payload, headers, prompt_len, args.timeout)

        rng = random.Random(args.seed)
        start = time.perf_counter()
        tasks = [asyncio.create_task(one(i)) async for i in _arrivals(len(prompts), args.request_rate, rng)]
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    metrics = compute_metrics(list(results), duration)
    if getattr(args, "save_detailed", False):
        metrics.update(detailed(list(results), start))
    metrics.update(
        {
            "base_url": args.base_url,
            "endpoint": args.endpoint,
            "model": args.model,
            "num_prompts": args.num_prompts,
            "random_input_len": args.random_input_len,
            "random_output_len": args.random_output_len,
            "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
            "max_concurrency": args.max_concurrency,
            "random_images": args.random_images,
            "random_image_size": str(args.random_image_size) if args.random_images else None,
        }
    )
    return metrics


def resolve_image_args(args: argparse.Namespace) -> str | None:
    """Fill in the default endpoint (chat with images); the usage error, if any."""
    if args.random_images < 0:
        return f"--random-images must be >= 0, not {args.random_images}"
    if args.endpoint == "auto":
        args.endpoint = "/v1/chat/completions" if args.random_images else "/v1/completions"
    if args.random_images and not args.endpoint.endswith("chat/completions"):
        return f"--random-images needs --endpoint /v1/chat/completions (images go in chat messages), not {args.endpoint}"
    if args.random_images and args.seed < 0:
        return f"--seed must be >= 0 with --random-images, not {args.seed}"
    return None


def run(args: argparse.Namespace) -> int:
    for name in ("num_prompts", "random_input_len", "random_output_len"):
        if getattr(args, name) < 1:
            print(f"halserve bench serve: error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.request_rate <= 0 or (args.max_concurrency is not None and args.max_concurrency < 1):
        print("halserve bench serve: error: --request-rate must be > 0 and --max-concurrency >= 1", file=sys.stderr)
        return 2
    error = resolve_image_args(args)
    if error:
        print(f"halserve bench serve: error: {error}", file=sys.stderr)
        return 2
    try:
        tokenizer = load_tokenizer(args.tokenizer or args.model)
    except Exception as exc:  # noqa: BLE001
        print(
            f"halserve bench serve: error: cannot load a tokenizer from {args.tokenizer or args.model!r} "
            f"({type(exc).__name__}: {exc}); pass --tokenizer PATH",
            file=sys.stderr,
        )
        return 2
    as_text = args.random_prompt_format == "text" or args.endpoint.endswith("chat/completions")
    prompts = sample_prompts(tokenizer, args.num_prompts, args.random_input_len, args.seed, as_text)
    images = random_image_urls(args.num_prompts, args.random_images, args.random_image_size, args.seed)
    warmup_images = warmup_image_urls(args.random_images, args.random_image_size, args.seed)
    try:
        metrics = asyncio.run(benchmark(args, prompts, images, warmup_images))
    except RuntimeError as exc:
        print(f"halserve bench serve: error: {exc}", file=sys.stderr)
        return 1
    print(format_table(metrics))
    if args.result_json:
        with open(args.result_json, "w", encoding="utf-8") as f:
            json.dump(metrics, f, indent=2)
    return 0 if metrics["completed"] == args.num_prompts else 1


def _result_dict(result: RequestResult) -> dict[str, Any]:  # for debugging dumps
    return asdict(result)

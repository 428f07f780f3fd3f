"""The transformers peer of ``e2e_halserve.py``: the same decode and offline workloads through
``model.generate`` with a static KV cache, whose decode step transformers compiles itself
(``torch.compile``, mode reduce-overhead: CUDA graphs) on a GPU.

    python benchmarks/gpu/e2e_transformers.py --model DIR --label llama-3.1-8b

Random weights from the config (``from_config`` on the device), as halserve's dummy load.
Decode tokens/s: ``batch * (new - 1) / (t(new tokens) - t(1 token))``, each ``generate`` timed after
one untimed call of the same shapes (the compile). Offline: ``--offline-prompts`` in batches of
``--offline-batch`` (one static shape), ``--offline-in`` / ``--offline-out`` tokens. Every figure is
printed as soon as it is measured (a step cut off by its time limit keeps what it printed).
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--label", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--offline-prompts", type=int, default=0)
    p.add_argument("--offline-batch", type=int, default=64)
    p.add_argument("--offline-in", type=int, default=512)
    p.add_argument("--offline-out", type=int, default=128)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--json", default=None)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    label = args.label or args.model
    config = AutoConfig.from_pretrained(args.model)
    start = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    print(f"[transformers] {label}: built on {device} in {time.perf_counter() - start:.1f}s", flush=True)
    gen = torch.Generator(device="cpu").manual_seed(0)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def generate(batch: int, prompt_len: int, new_tokens: int) -> float:
        ids = torch.randint(10, config.vocab_size, (batch, prompt_len), generator=gen).to(device)
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                      cache_implementation="static", pad_token_id=config.eos_token_id,
                      attention_mask=torch.ones_like(ids), disable_compile=args.no_compile)
        sync()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, **kwargs)
        sync()
        assert out.shape[1] == prompt_len + new_tokens, out.shape
        return time.perf_counter() - start

    results: dict = {"label": label, "decode": [], "offline": None}

    def save() -> None:  # after every figure: a step cut off by its time limit keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)

    for batch in args.batch:
        new = args.decode_steps + 1
        generate(batch, args.context, new)  # compile (the decode step, at this batch and cache size)
        generate(batch, args.context, 1)
        # best of three each: on a busy host one slow prefill run can exceed the whole generate's time
        total = min(generate(batch, args.context, new) for _ in range(3))
        prefill = min(generate(batch, args.context, 1) for _ in range(3))
        decode_only = total > prefill
        # (where noise still swamps the decode steps, the whole run per token: a lower bound on the speed)
        step_s = (total - prefill) / (new - 1) if decode_only else total / new
        row = {"batch": batch, "context": args.context, "step_ms": step_s * 1e3, "tokens_per_s": batch / step_s,
               "prefill_subtracted": decode_only}
        results["decode"].append(row)
        print(f"[transformers] {label} decode batch {batch:3d} ctx {args.context} static+compile: "
              f"{row['tokens_per_s']:9.1f} tok/s ({row['step_ms']:.2f} ms/step)", flush=True)
        save()
    if args.offline_prompts:
        batches = -(-args.offline_prompts // args.offline_batch)
        generate(args.offline_batch, args.offline_in, args.offline_out)  # compile
        elapsed = sum(generate(args.offline_batch, args.offline_in, args.offline_out) for _ in range(batches))
        num = batches * args.offline_batch
        results["offline"] = {"prompts": num, "input_len": args.offline_in, "output_len": args.offline_out,
                              "elapsed_s": elapsed, "output_tokens_per_s": num * args.offline_out / elapsed,
                              "total_tokens_per_s": num * (args.offline_in + args.offline_out) / elapsed}
        print(f"[transformers] {label} offline {num} x {args.offline_in} in / {args.offline_out} out "
              f"(batches of {args.offline_batch}): {results['offline']['output_tokens_per_s']:.1f} output tok/s "
              f"({elapsed:.2f} s)", flush=True)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""halserve end to end on one model folder (``--load-format dummy``): decode tokens/s with captured
graphs and eagerly, beside the roofline, and offline throughput.

    python benchmarks/gpu/e2e_halserve.py --model DIR --label llama-3.1-8b --peak-gbps 3350

Decode: ``--batch`` requests with ``--context``-token random prompts are prefilled, then
``--decode-steps`` engine steps are timed (every step: one token for each request). Each step
reads every weight once and the K/V of every request's context, so the roofline is

    step time >= (weight bytes + batch * context * KV bytes per token) / HBM bandwidth

(the input embedding reads only ``batch`` rows: it is not counted). The same engine measures
with graphs, then with its graphs dropped (what ``--enforce-eager`` runs: the same kernels,
each launched from Python). Offline: ``--offline-prompts`` random prompts of ``--offline-in``
tokens, ``--offline-out`` new tokens each (ignore_eos), all submitted at once, with graphs.
Prints one line per figure and writes them all to ``--json``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a folder with config.json and a tokenizer")
    p.add_argument("--label", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--platform", default=None)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--peak-gbps", type=float, default=3350.0, help="HBM bandwidth, GB/s (H100 3350, H200 4800)")
    p.add_argument("--offline-prompts", type=int, default=0, help="0: no offline run")
    p.add_argument("--offline-in", type=int, default=512)
    p.add_argument("--offline-out", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--no-eager", action="store_true", help="graphs only")
    p.add_argument("--async-scheduling", action="store_true",
                   help="the engine schedules step N+1 while step N runs (the uni executor: its runner is read "
                        "here); rows are named graphs+async / eager+async")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="after each decode figure, profile STEPS more steps (torch.profiler): wall vs device time "
                        "per step, kernel launches per step, the costliest kernels and host ops")
    p.add_argument("--json", default=None)
    return p.parse_args()


WARMUP_STEPS = 4


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[dict]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": row} for row in rng.integers(10, vocab, size=(num, length)).tolist()]


def weight_bytes(model) -> int:
    """Bytes a decode step reads from the weights: every weight storage (parameters, and the copies
    the GEMM kernels prepared from them, which replace the parameters: halserve.platforms.weight_moves)
    except the input embedding (a step reads ``batch`` rows of it; counted when tied to the LM head,
    which reads it whole) and buffers (the rotary tables: a step reads a few rows)."""
    from halserve.platforms.weight_moves import weight_storages

    def key(t) -> tuple[str, int]:
        return str(t.device), t.untyped_storage().data_ptr()

    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    lm_head = getattr(model, "lm_head", None)
    embedding = {key(p) for p in embed.parameters()} if embed is not None else set()
    tied = lm_head is not None and any(key(p) in embedding for p in lm_head.parameters())
    skip = {key(b) for b in model.buffers()} | (set() if tied else embedding)
    return sum(t.untyped_storage().nbytes() for t in weight_storages(model) if key(t) not in skip)


def profile_steps(engine, steps: int, title: str) -> dict:
    """``steps`` engine steps under torch.profiler: per step, the wall time, the time the device's kernels
    ran (their durations summed: one stream, so not overlapping), how many kernels ran; and the costliest
    kernels and host-side ops. Where kernels run back to back the device time is the step; the gap between
    the two is the host's share (Python, launches, syncs)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    averages = prof.key_averages()

    def device_us(e) -> float:
        return float(getattr(e, "self_device_time_total", 0.0) or 0.0)

    kernels = [e for e in averages if device_us(e) > 0 and not e.key.startswith(("cuda", "Memcpy", "Memset"))]
    device = sum(device_us(e) for e in kernels) / 1e3 / steps  # ms per step
    launches = sum(e.count for e in kernels) / steps
    top_kernels = sorted(kernels, key=device_us, reverse=True)[:6]
    host = sorted((e for e in averages if e.self_cpu_time_total > 0), key=lambda e: e.self_cpu_time_total, reverse=True)[:6]
    out = {"wall_ms": wall * 1e3, "device_ms": device, "kernels_per_step": launches,
           "top_kernels": [(e.key[:60], device_us(e) / 1e3 / steps) for e in top_kernels],
           "top_host_ops": [(e.key[:60], e.self_cpu_time_total / 1e3 / steps, e.count / steps) for e in host]}
    print(f"[profile] {title}: wall {out['wall_ms']:.2f} ms/step, device kernels {device:.2f} ms/step "
          f"({device / out['wall_ms']:.0%}), {launches:.0f} kernels/step", flush=True)
    print("[profile]   kernels (ms/step): " + "; ".join(f"{k} {ms:.3f}" for k, ms in out["top_kernels"]), flush=True)
    print("[profile]   host ops (self ms/step, calls/step): "
          + "; ".join(f"{k} {ms:.3f} x{n:.0f}" for k, ms, n in out["top_host_ops"]), flush=True)
    return out


def decode(engine, batch: int, context: int, steps: int, vocab: int, seed: int,
           profile: int = 0, title: str = "", lagged: bool = False) -> tuple[float, dict | None]:
    """Seconds per decode step of ``batch`` requests at about ``context`` tokens (and, with ``profile``,
    that many more steps' profile). ``lagged`` (async scheduling): a step returns the outputs of the one
    before, so the timed steps are counted by the tokens they returned, not asserted one per request."""
    from halserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + WARMUP_STEPS + profile + 16, ignore_eos=True,
                            detokenize=False)
    ids = [f"decode-{batch}-{seed}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, random_prompts(batch, context, vocab, seed)):
        engine.add_request(rid, prompt, params)
    done: dict[str, int] = {}
    deadline = time.monotonic() + 300
    while len([n for n in done.values() if n >= 2]) < batch:  # prefilled, and one decode step behind them
        for out in engine.step():
            done[out.request_id] = len(out.outputs[0].token_ids)
        if time.monotonic() > deadline:
            raise RuntimeError(f"prefill of {batch} x {context} did not finish in 300 s")
    for _ in range(WARMUP_STEPS):  # (kernels this batch shape compiles on first use: not timed)
        engine.step()
    start = time.perf_counter()
    advanced = 0
    for _ in range(steps):
        outs = engine.step()
        advanced += len(outs)
        assert lagged or len(outs) == batch, f"a decode step advanced {len(outs)} of {batch} requests"
    elapsed = time.perf_counter() - start
    if lagged:  # (steady state: every step answers each request once; one more or less at the edges)
        assert abs(advanced - steps * batch) <= batch, (advanced, steps, batch)
    profiled = profile_steps(engine, profile, title) if profile else None
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed / steps, profiled


def main() -> int:
    args = parse_args()
    from halserve import LLM, SamplingParams

    label = args.label or args.model
    llm = LLM(args.model, load_format="dummy", dtype=args.dtype, platform=args.platform,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
              **({"async_scheduling": True, "distributed_executor_backend": "uni"} if args.async_scheduling else {}))
    engine = llm.llm_engine
    runner = engine.core.executor.worker.model_runner
    info = engine.model_info
    weights = weight_bytes(runner.model)
    print(f"[halserve] {label}: {weights / 1e9:.2f} GB of weights, KV {info.kv_cache_bytes_per_token} B/token, "
          f"backend {runner.attn_backend_cls.name}, graphs {'captured: ' + str(runner.step_graphs.sizes[-1]) if runner.step_graphs else 'none'}",
          flush=True)
    results: dict = {"label": label, "weight_bytes": weights, "peak_gbps": args.peak_gbps, "decode": [], "offline": None}

    def save() -> None:  # after every figure: a step cut off by its time limit keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)

    graphs = runner.step_graphs
    modes = ["graphs"] + ([] if args.no_eager else ["eager"])
    for mode in modes:
        runner.step_graphs = graphs if mode == "graphs" else None  # eager: what --enforce-eager runs
        name = mode + ("+async" if args.async_scheduling else "")
        if mode == "graphs" and graphs is None:
            print(f"[halserve] {label}: no graphs were captured on this platform; 'graphs' rows run eagerly")
        for batch in args.batch:
            step_s, profiled = decode(engine, batch, args.context, args.decode_steps, info.vocab_size, seed=batch,
                                      profile=args.profile, title=f"{label} batch {batch} {name}",
                                      lagged=args.async_scheduling)
            kv = batch * (args.context + WARMUP_STEPS + args.decode_steps // 2) * info.kv_cache_bytes_per_token
            roof_s = (weights + kv) / (args.peak_gbps * 1e9)
            row = {"mode": name, "batch": batch, "context": args.context, "step_ms": step_s * 1e3,
                   "tokens_per_s": batch / step_s, "roofline_tokens_per_s": batch / roof_s,
                   "fraction_of_roofline": roof_s / step_s, "profile": profiled}
            results["decode"].append(row)
            print(f"[halserve] {label} decode batch {batch:3d} ctx {args.context} {name:6s}: "
                  f"{row['tokens_per_s']:9.1f} tok/s ({row['step_ms']:.2f} ms/step); roofline "
                  f"{row['roofline_tokens_per_s']:9.1f} tok/s ({row['fraction_of_roofline']:.0%})", flush=True)
            save()
    runner.step_graphs = graphs
    if args.offline_prompts:
        prompts = random_prompts(args.offline_prompts, args.offline_in, info.vocab_size, seed=1)
        params = SamplingParams(temperature=0.0, max_tokens=args.offline_out, ignore_eos=True, detokenize=False)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
        results["offline"] = {"prompts": len(prompts), "input_len": args.offline_in, "output_len": args.offline_out,
                              "elapsed_s": elapsed, "output_tokens_per_s": num_out / elapsed,
                              "total_tokens_per_s": (num_out + len(prompts) * args.offline_in) / elapsed}
        print(f"[halserve] {label} offline {len(prompts)} x {args.offline_in} in / {args.offline_out} out: "
              f"{results['offline']['output_tokens_per_s']:.1f} output tok/s, "
              f"{results['offline']['total_tokens_per_s']:.1f} total tok/s ({elapsed:.2f} s)", flush=True)
    save()
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

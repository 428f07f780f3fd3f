"""What the KV connectors buy on this machine: prefill skipped by loading K/V instead of computing it.

    python benchmarks/kv_connectors.py [--model bench_out/W1] [--dtype float32] [--repeats 3]

Workload W1 (``benchmarks/workloads.py``; written under ``--model``'s directory if missing), greedy,
``ignore_eos``, every prompt random tokens (seeded; the same in every repetition). Each engine is a
fresh ``LLM`` (deleted, then ``gc.collect()``, before the next one is made), warmed up with
``--warmup-prompts`` prompts of the same shape before its timed ``generate`` (the first run of an
engine has one-time costs); wall times by ``time.perf_counter`` around ``generate``. Each phase runs
``--repeats`` times, its engines in the same order every time; the median wall time of each engine
is reported, with every run's. Nothing is asserted on the timings. ``cpu/wall`` is this process's
CPU seconds over wall seconds during the timed ``generate`` (~2, the thread count, when it computes
on a quiet 2-core machine; lower while it waits for a disk); ``others`` the other processes' (from
``/proc/stat``): a run where they took more than 0.15 CPU seconds a second is marked ``*`` / BUSY,
and its figure is not that of a quiet machine.

a. **SharedStorageConnector, a second engine.** ``--storage-prompts`` distinct prompts of
   ``--storage-len`` tokens, ``max_tokens=1`` (prefill only, TTFT-like), all submitted at once:
   a plain engine (no connector) computes them (the baseline); engine A (``kv_both``, a fresh
   directory) computes them and saves every full block to the directory (save overhead = A - plain;
   the storage's size on disk); then a fresh engine B (``kv_both``) on the same directory runs them
   again and loads what A saved (all but the last block of each prompt: the last token is always
   computed, for its logits), its files still in the OS page cache (just written); then a fresh
   engine C does the same after the directory's files were synced and dropped from the page cache
   (``posix_fadvise(DONTNEED)`` on each file: read back from the disk). B's and C's warm-up prompts
   are A's, so their warm-ups exercise the load path too. Prints B's and C's greedy tokens and
   logprobs against the plain engine's.
b. **OffloadingConnector under cache pressure.** ``--offload-prompts`` prompts of ``--offload-len``
   tokens, ``--offload-output`` tokens out each (round 1); then round 2: each prompt again, followed
   by its round-1 output and ``--offload-followup`` new tokens (a second turn). The device KV cache
   holds ``--offload-kv-blocks`` blocks (default: room for ~2.5 round-2 requests) and
   ``--offload-max-seqs`` requests run at once, so round 1 evicts the earlier prompts' blocks from
   the device prefix cache and round 2 finds none of them there. Engines: no connector (round 2
   recomputes), OffloadingConnector with ``num_cpu_blocks`` holding every block of both rounds
   (round 2 copies the prompts' blocks back from host memory), and, as a bound, no connector with a
   device cache big enough for everything (round 2 hits the device prefix cache). Prints each
   engine's greedy tokens and logprobs against the recompute's, and the OffloadingConnector's against
   the big cache's.

The connectors' transfers are synchronous in halserve: loads before the step's forward, saves
after it. The storage directories are fresh temporary ones (``--tmp-dir``), removed at the end.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import random
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from workloads import VOCAB, ensure_checkpoint  # noqa: E402


def random_prompts(rng: random.Random, num: int, length: int) -> list[list[int]]:
    return [[rng.randrange(10, VOCAB) for _ in range(length)] for _ in range(num)]


def engine_stats(llm) -> dict:
    s = llm.llm_engine.get_stats()
    return {"hit": s.kv_connector_hit_tokens, "prefix": s.prefix_cache_hits, "preempt": s.num_preemptions}


def machine_busy_seconds() -> float:
    """CPU seconds every process on the machine has used since boot (``/proc/stat``; 0 where it is missing)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    # user nice system idle iowait irq softirq steal ...: all but idle and iowait
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def timed_generate(llm, prompts: list[list[int]], params) -> dict:
    """One timed ``generate``: wall seconds, outputs, the engine's counters over it, this process's
    CPU seconds / wall (``cpu``) and the other processes' (``others``: ~0 on a quiet machine)."""
    before = engine_stats(llm)
    m0, c0, t0 = machine_busy_seconds(), time.process_time(), time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    cpu, machine = time.process_time() - c0, machine_busy_seconds() - m0
    after = engine_stats(llm)
    run = {k: after[k] - before[k] for k in after}
    run.update(wall=wall, outs=outs, cpu=cpu / wall, others=max(0.0, machine - cpu) / wall)
    return run


def warm_up(llm, prompts: list[list[int]], params) -> None:
    if prompts:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def tokens_of(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def match_line(name: str, outs, ref) -> str:
    a, b = tokens_of(outs), tokens_of(ref)
    same = sum(x == y for x, y in zip(a, b))
    toks = sum(sum(u == v for u, v in zip(x, y)) for x, y in zip(a, b))
    total = sum(len(y) for y in b)
    diff = max(abs(x.outputs[0].cumulative_logprob - y.outputs[0].cumulative_logprob) for x, y in zip(outs, ref))
    firsts = [next(i for i, (u, v) in enumerate(zip(x, y)) if u != v) for x, y in zip(a, b) if x != y]
    where = f" (first difference at output token {min(firsts)})" if firsts else ""
    return (f"{name}: greedy tokens {'MATCH' if same == len(b) else 'DIFFER'}: {same}/{len(b)} requests, "
            f"{toks}/{total} tokens equal{where}; max |cumulative logprob diff| {diff:.2e}")


def dir_files(path: str) -> list[str]:
    return [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]


def drop_from_page_cache(path: str) -> None:
    """Write the directory's files to disk and drop them from the OS page cache (only these files)."""
    for name in dir_files(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def make_llm(args, **kwargs):
    from halserve import LLM

    return LLM(args.model, platform="cpu", dtype=args.dtype, block_size=args.block_size, **kwargs)


def median_run(runs: list[dict]) -> dict:
    """The run of median wall time, with every run's wall time and cpu/wall attached."""
    ordered = sorted(runs, key=lambda r: r["wall"])
    best = dict(ordered[(len(ordered) - 1) // 2])
    best["all"] = " / ".join(f"{r['wall']:.2f}{'*' if r['others'] > BUSY else ''}" for r in runs)
    best["cpus"] = " / ".join(f"{r['cpu']:.2f}" for r in runs)
    return best


BUSY = 0.15  # other processes' CPU seconds a wall second above which a run is marked (*)


def fmt_run(r: dict) -> str:
    busy = " BUSY" if r["others"] > BUSY else ""
    return (f"{r['wall']:.2f} s, cpu/wall {r['cpu']:.2f}, others {r['others']:.2f}{busy}, connector-loaded "
            f"{r['hit']}, prefix-cache hits {r['prefix']}, preemptions {r['preempt']}")


def storage_phase(args, rng: random.Random) -> None:
    from halserve import SamplingParams

    L, N, bs = args.storage_len, args.storage_prompts, args.block_size
    warm = random_prompts(rng, args.warmup_prompts, L)
    prompts = random_prompts(rng, N, L)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=1)
    common = dict(num_kv_blocks=(N + len(warm)) * (math.ceil((L + 1) / bs) + 1), max_model_len=L + 16,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    names = ["plain (no connector)", "A: SharedStorage kv_both, computes + saves",
             "B: fresh engine, same dir, loads (page cache)", "C: fresh engine, same dir, loads (from disk)"]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    written: list[tuple[int, int]] = []
    print(f"\n== a. SharedStorageConnector: {N} prompts x {L} tokens, max_tokens=1, {args.repeats} repetitions",
          flush=True)
    for rep in range(args.repeats):
        path = tempfile.mkdtemp(prefix="halserve-kv-storage-", dir=args.tmp_dir)
        storage = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"shared_storage_path": path}}
        try:
            for name in names:
                connector = {} if name.startswith("plain") else {"kv_transfer_config": storage}
                if name.startswith("C"):
                    drop_from_page_cache(path)
                llm = make_llm(args, **connector, **common)
                warm_up(llm, warm, params)
                files0 = dir_files(path)
                run = timed_generate(llm, prompts, params)
                del llm
                gc.collect()
                if name.startswith("A"):
                    new = set(dir_files(path)) - set(files0)
                    written.append((len(new), sum(os.path.getsize(f) for f in new)))
                runs[name].append(run)
                print(f"[{rep + 1}] {name}: {fmt_run(run)}", flush=True)
        finally:
            if args.keep_storage:
                print(f"(storage kept at {path})")
            else:
                shutil.rmtree(path, ignore_errors=True)
    med = {name: median_run(r) for name, r in runs.items()}
    plain = med[names[0]]
    print("\n| engine | median wall s (all runs) | cpu/wall | prompt tok/s | tokens computed | tokens loaded | "
          "vs plain |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        r = med[name]
        computed = N * L - r["hit"] - r["prefix"]
        ratio = plain["wall"] / r["wall"]
        vs = "-" if r is plain else (f"{r['wall'] / plain['wall']:.3f}x the time" if ratio < 1.5 else
                                     f"{ratio:.1f}x faster")
        print(f"| {name} | {r['wall']:.2f} ({r['all']}) | {r['cpus']} | {N * L / r['wall']:.0f} | {computed} | "
              f"{r['hit']} | {vs} |")
    files, size = written[0]
    a = med[names[1]]
    print(f"\nstorage written by A's timed run: {files} files, {size / 2**20:.1f} MiB ({size / files / 1024:.1f} KiB "
          f"a block of {bs} tokens); save overhead A - plain (medians): {a['wall'] - plain['wall']:+.2f} s "
          f"({(a['wall'] - plain['wall']) / files * 1e3:+.2f} ms a block)")
    for name in names[1:]:
        for i, run in enumerate(runs[name]):
            print(match_line(f"[{i + 1}] {name.split(':')[0]} vs plain", run["outs"], runs[names[0]][i]["outs"]))


def offload_phase(args, rng: random.Random) -> None:
    from halserve import SamplingParams

    L, M, T, F, bs = args.offload_len, args.offload_prompts, args.offload_output, args.offload_followup, args.block_size
    warm = random_prompts(rng, args.warmup_prompts, L)
    prompts = random_prompts(rng, M, L)
    followups = random_prompts(rng, M, F)
    params = SamplingParams(temperature=0, max_tokens=T, ignore_eos=True, logprobs=1)
    len2 = L + T + F
    blocks2 = math.ceil((len2 + T) / bs)  # a round-2 request's blocks at its end
    room = args.offload_kv_blocks or int(2.5 * blocks2)
    cpu_blocks = args.cpu_blocks or 2 * (M + len(warm)) * blocks2
    big = 2 * (M + len(warm)) * blocks2
    common = dict(max_model_len=len2 + T + 16, max_num_seqs=args.offload_max_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    offload = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"num_cpu_blocks": cpu_blocks}}
    engines = [("no connector (recompute)", dict(num_kv_blocks=room)),
               ("OffloadingConnector", dict(num_kv_blocks=room, kv_transfer_config=offload))]
    if not args.skip_big_cache:
        engines.append((f"no connector, device cache {big} blocks", dict(num_kv_blocks=big)))
    print(f"\n== b. OffloadingConnector: {M} prompts x {L} tokens -> {T} tokens; round 2: prompt + its output + "
          f"{F} new tokens ({len2} tokens) -> {T}; device cache {room} blocks of {bs} (a round-2 request needs "
          f"{blocks2}), max_num_seqs {args.offload_max_seqs}, num_cpu_blocks {cpu_blocks}; {args.repeats} "
          f"repetitions", flush=True)
    runs: dict[str, list[tuple[dict, dict]]] = {name: [] for name, _ in engines}
    for rep in range(args.repeats):
        for name, kwargs in engines:
            llm = make_llm(args, **common, **kwargs)
            warm_up(llm, warm, params)
            r1 = timed_generate(llm, prompts, params)
            second = [p + o + f for p, o, f in zip(prompts, tokens_of(r1["outs"]), followups)]
            r2 = timed_generate(llm, second, params)
            r2["cached"] = sum(o.num_cached_tokens or 0 for o in r2["outs"])
            del llm
            gc.collect()
            runs[name].append((r1, r2))
            print(f"[{rep + 1}] {name}: round 1 {fmt_run(r1)}; round 2 {fmt_run(r2)}, "
                  f"num_cached_tokens {r2['cached']}", flush=True)
    med1 = {name: median_run([r[0] for r in rs]) for name, rs in runs.items()}
    med2 = {name: median_run([r[1] for r in rs]) for name, rs in runs.items()}
    base = engines[0][0]
    print("\n| engine | round 1 median s (all) | round 2 median s (all) | round 2 cpu/wall | round 2 vs recompute | "
          "round-2 tokens loaded by connector | round-2 device prefix-cache hits | round-2 tokens computed |")
    print("|---|---|---|---|---|---|---|---|")
    for name, _ in engines:
        r1, r2 = med1[name], med2[name]
        computed = M * len2 - r2["hit"] - r2["prefix"]
        print(f"| {name} | {r1['wall']:.2f} ({r1['all']}) | {r2['wall']:.2f} ({r2['all']}) | {r2['cpus']} | "
              f"{med2[base]['wall'] / r2['wall']:.2f}x | {r2['hit']} | {r2['prefix']} | {computed} |")
    print(f"\nround 1 (saves every block to host) OffloadingConnector / no connector, medians: "
          f"{med1['OffloadingConnector']['wall'] / med1[base]['wall']:.3f}")
    for name, _ in engines[1:]:
        for i, (r1, r2) in enumerate(runs[name]):
            ref1, ref2 = runs[base][i]
            print(match_line(f"[{i + 1}] {name} vs recompute, round 1", r1["outs"], ref1["outs"]))
            print(match_line(f"[{i + 1}] {name} vs recompute, round 2", r2["outs"], ref2["outs"]))
    if len(engines) > 2:  # (both find the prompts' K/V: the host copy should give the device hit's outputs)
        for i, ((_, off2), (_, big2)) in enumerate(zip(runs[engines[1][0]], runs[engines[2][0]])):
            print(match_line(f"[{i + 1}] OffloadingConnector vs {engines[2][0]}, round 2", off2["outs"], big2["outs"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.join("bench_out", "W1"))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each phase; medians reported")
    ap.add_argument("--warmup-prompts", type=int, default=2, help="prompts of each phase's shape, run untimed first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tmp-dir", default=None, help="where the storage directories are made (default: the system's)")
    ap.add_argument("--keep-storage", action="store_true")
    ap.add_argument("--skip-storage", action="store_true")
    ap.add_argument("--skip-offload", action="store_true")
    ap.add_argument("--storage-prompts", type=int, default=16)
    ap.add_argument("--storage-len", type=int, default=1024)
    ap.add_argument("--offload-prompts", type=int, default=8)
    ap.add_argument("--offload-len", type=int, default=1024)
    ap.add_argument("--offload-output", type=int, default=16)
    ap.add_argument("--offload-followup", type=int, default=32)
    ap.add_argument("--offload-kv-blocks", type=int, default=None,
                    help="device KV cache blocks (default: 2.5 round-2 requests' worth)")
    ap.add_argument("--offload-max-seqs", type=int, default=2)
    ap.add_argument("--cpu-blocks", type=int, default=None,
                    help="OffloadingConnector num_cpu_blocks (default: twice every block of both rounds)")
    ap.add_argument("--skip-big-cache", action="store_true", help="skip the engine whose device cache holds all")
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.model, "model.safetensors")):
        args.model = ensure_checkpoint("W1", os.path.dirname(args.model) or ".")

    import torch

    print(f"model {args.model}, dtype {args.dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}", flush=True)
    t0 = time.perf_counter()
    rng = random.Random(args.seed)
    if not args.skip_storage:
        storage_phase(args, rng)
    if not args.skip_offload:
        offload_phase(args, rng)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; timed runs marked * (BUSY) had other processes using over "
          f"{BUSY} CPU seconds a second: their figures are not those of a quiet machine")


if __name__ == "__main__":
    main()

"""Where a served request's time to first token goes (BENCHMARKS.md, "Where a W2 TTFT goes").

    python benchmarks/ttft_anatomy.py [--workload W2] [--num-prompts 256] [--max-concurrency 64] [-- SERVE FLAGS]

Starts `halserve serve` on the workload's checkpoint and drives it with `halserve bench serve`, with a tracer loaded
into every process (a `sitecustomize` module on PYTHONPATH: nothing in halserve changes) that records, on the
system's monotonic clock (`time.perf_counter`, the same in every process):

    client      each request's send and the arrival of its first token   (halserve.bench.serve.send_request)
    API server  each request's prepare (body parsed, before tokenizing)   (AsyncLLM.prepare_request)
                each request handed to the engine-core client             (MPEngineCoreClient.add_requests)
                each batch of engine outputs processed                    (AsyncLLM._on_outputs)
    engine core each request added (the core takes them between steps)    (EngineCore.add_request)
                each step: start, end, tokens, requests, prompts in it    (EngineCore.step, Scheduler.schedule)

and prints the median / mean / p90 of each leg of the way, in milliseconds:

    client send -> API prepare       HTTP in, the API server's event loop
    API prepare -> submitted         tokenize, validate, the request handed to the engine-core client
    submitted -> engine add          the way to the core, and the wait for the step in flight to end
    engine add -> first step start   the core's poll between steps
    first step start -> first token's step end
                                     its prompt's prefill (one step, or more when the prompt is split in chunks)
    step end -> API outputs done     the outputs' way back and their processing (detokenize, streams)
    API outputs done -> client       the SSE chunk out, the client's read

Requests are matched in order (the k-th send with the k-th prepare and the k-th add: FIFO at each stage); a
request's first step is the first to start after its add, its first token's batch the last output batch processed
before the client read it, and that batch's step the last to end before the batch was processed.
Run under `flock /tmp/cpu.lock` on a shared machine.
"""
from __future__ import annotations

import argparse
import bisect
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare_serving import bench_settings, free_port, stop_server, wait_healthy  # noqa: E402
from workloads import ensure_checkpoint  # noqa: E402

TRACER = r'''
import atexit, os, time
_dir = os.environ.get("HALSERVE_TTFT_TRACE")
if _dir:
    _rows = []
    _last = [time.perf_counter()]

    def _flush():
        if _rows:
            with open(os.path.join(_dir, f"trace_{os.getpid()}.txt"), "a") as f:
                f.writelines(" ".join(map(str, row)) + "\n" for row in _rows)
            _rows.clear()

    def _note(*row):  # (flushed every 0.5 s: a spawned engine-core process exits without atexit)
        _rows.append(row)
        if len(_rows) >= 256 or row[1] - _last[0] > 0.5:
            _flush()
            _last[0] = row[1]

    atexit.register(_flush)
    import signal as _signal
    _old = _signal.getsignal(_signal.SIGTERM)

    def _on_term(signum, frame):  # (the server's processes stop on SIGTERM: keep what was traced)
        _flush()
        if callable(_old):
            _old(signum, frame)
        else:
            raise SystemExit(0)

    _signal.signal(_signal.SIGTERM, _on_term)

    def _wrap(cls, name, before=None, after=None, is_async=False):
        original = getattr(cls, name)
        if is_async:
            async def wrapped(self, *a, **k):
                before and before(self, *a)
                return await original(self, *a, **k)
        else:
            def wrapped(self, *a, **k):
                t = time.perf_counter()
                before and before(self, *a)
                out = original(self, *a, **k)
                after and after(self, t, out, *a)
                return out
        setattr(cls, name, wrapped)

    import halserve.bench.serve as _bs
    _send = _bs.send_request

    async def _send_request(*a, **k):
        r = await _send(*a, **k)
        if r.success:
            _note("C", r.sent_at, r.sent_at + r.ttft)
        return r

    _bs.send_request = _send_request
    from halserve import scheduler as _sched
    from halserve.engine import async_llm as _al, core as _core

    def _scheduled(self, t, out):
        n = out.num_scheduled_tokens
        self._ttft_trace = (out.total_num_scheduled_tokens, len(n), sum(1 for v in n.values() if v > 1))

    _wrap(_sched.Scheduler, "schedule", after=_scheduled)
    _wrap(_core.EngineCore, "step",
          after=lambda self, t, out: _note("S", t, time.perf_counter(), *getattr(self.scheduler, "_ttft_trace", (0, 0, 0))))
    _wrap(_core.EngineCore, "add_request", before=lambda self, *a: _note("A", time.perf_counter()))
    _wrap(_al.AsyncLLM, "prepare_request", before=lambda self, *a: _note("P", time.perf_counter()), is_async=True)
    from halserve.engine import core_client as _cc
    _wrap(_cc.MPEngineCoreClient, "add_requests", before=lambda self, *a: _note("W", time.perf_counter()),
          is_async=True)
    _wrap(_al.AsyncLLM, "_on_outputs", after=lambda self, t, out, outs: _note("O", t, time.perf_counter(), len(outs)))
'''


def legs(trace_dir: str, num: int, end: float) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Each leg's milliseconds per request (the last ``num`` requests before ``end``: the measured load), and step
    figures."""
    rows: list[tuple[str, list[float]]] = []
    for path in glob.glob(os.path.join(trace_dir, "trace_*.txt")):
        with open(path) as f:
            rows += [(p[0], [float(x) for x in p[1:]]) for p in (line.split() for line in f)]
    rows = [(kind, values) for kind, values in rows if values[0] <= end]
    get = lambda kind: sorted(v for k, v in rows if k == kind)  # noqa: E731
    sends, steps, outs = get("C"), get("S"), get("O")
    prepares, submits, adds = ([v[0] for v in get(kind)] for kind in ("P", "W", "A"))
    if len(sends) < num or min(len(prepares), len(submits), len(adds)) < len(sends):
        raise SystemExit(f"incomplete trace in {trace_dir}: {len(sends)} sends, {len(prepares)} prepares, "
                         f"{len(adds)} adds for {num} requests")
    # FIFO at each stage: the measured load is the last num of each
    sends, prepares, submits, adds = sends[-num:], prepares[-num:], submits[-num:], adds[-num:]
    step_starts, step_ends = [s[0] for s in steps], [s[1] for s in steps]
    out_ends = [o[1] for o in outs]
    out = {k: [] for k in ("client TTFT", "client send -> API prepare", "API prepare -> submitted",
                           "submitted -> engine add",
                           "engine add -> first step start", "first step start -> first token's step end",
                           "step end -> API outputs done", "API outputs done -> client")}
    for (sent, first), prep, submit, add in zip(sends, prepares, submits, adds):
        i = bisect.bisect_left(step_starts, add)  # the first step after its add: where it was first scheduled
        j = bisect.bisect_right(out_ends, first) - 1  # the last output batch done before its first token arrived
        if i == len(steps) or j < 0:
            continue
        k = bisect.bisect_right(step_ends, outs[j][0]) - 1  # the step whose outputs that batch was
        if k < i:
            continue
        for key, value in (("client TTFT", first - sent), ("client send -> API prepare", prep - sent),
                           ("API prepare -> submitted", submit - prep), ("submitted -> engine add", add - submit),
                           ("engine add -> first step start", steps[i][0] - add),
                           ("first step start -> first token's step end", steps[k][1] - steps[i][0]),
                           ("step end -> API outputs done", outs[j][1] - steps[k][1]),
                           ("API outputs done -> client", first - outs[j][1])):
            out[key].append(1000.0 * value)
    load = [s for s in steps if s[0] >= sends[0][0]]
    with_prompts = [s for s in load if s[4] > 0]
    decode_only = [s for s in load if s[4] == 0 and s[2] > 0]
    figures = {
        "steps": len(load),
        "steps with prompts": len(with_prompts),
        "prompts per such step (mean)": statistics.fmean(s[4] for s in with_prompts) if with_prompts else 0.0,
        "ms a step with prompts (median)": statistics.median(1000 * (s[1] - s[0]) for s in with_prompts)
        if with_prompts else 0.0,
        "ms a decode-only step (median)": statistics.median(1000 * (s[1] - s[0]) for s in decode_only)
        if decode_only else 0.0,
    }
    return out, figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="W2")
    ap.add_argument("--models-dir", default=os.path.join("bench_out", "models"))
    ap.add_argument("--num-prompts", type=int, default=None, help="default: the workload's")
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("serve_flags", nargs="*", help="after --: more `halserve serve` flags")
    args = ap.parse_args()
    w = bench_settings(args.workload)
    num = args.num_prompts or w["num_prompts"]
    path = os.path.abspath(ensure_checkpoint(args.workload, args.models_dir))
    trace_dir = tempfile.mkdtemp(prefix="ttft_trace_")
    with open(os.path.join(trace_dir, "sitecustomize.py"), "w") as f:
        f.write(TRACER)
    env = dict(os.environ, HALSERVE_TTFT_TRACE=trace_dir,
               PYTHONPATH=trace_dir + os.pathsep + os.environ.get("PYTHONPATH", ""))
    port = free_port()
    cmd = [sys.executable, "-m", "halserve.entrypoints.cli", "serve", path, "--platform", "cpu", "--dtype", args.dtype,
           "--no-enable-prefix-caching", "--host", "127.0.0.1", "--served-model-name", path, "--port", str(port),
           *args.serve_flags]
    print("$", " ".join(cmd), flush=True)
    log = os.path.join(trace_dir, "serve.log")
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=tempfile.gettempdir())
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, 900)
        bench = [sys.executable, "-m", "halserve.entrypoints.cli", "bench", "serve", "--base-url", base, "--model", path,
                 "--tokenizer", path, "--random-input-len", str(w["input_len"]), "--random-output-len",
                 str(w["output_len"]), "--max-concurrency", str(args.max_concurrency), *w["flags"]]
        subprocess.run([*bench, "--num-prompts", str(args.max_concurrency)], env=env, check=True,
                       stdout=subprocess.DEVNULL)  # warm-up
        result = os.path.join(trace_dir, "result.json")
        subprocess.run([*bench, "--num-prompts", str(num), "--result-json", result], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        end = time.perf_counter()
        time.sleep(0.6)  # one more request: every process's tracer writes what it holds (written each 0.5 s)
        subprocess.run([*bench, "--num-prompts", "1"], env=env, check=True, stdout=subprocess.DEVNULL)
        with open(result) as f:
            m = json.load(f)
    finally:
        stop_server(proc)
    per_leg, figures = legs(trace_dir, num, end)
    print(f"\n{args.workload}, {num} requests at concurrency {args.max_concurrency}, flags {args.serve_flags or '-'}: "
          f"{m['output_throughput']:.1f} output tok/s, p50 TTFT {m['median_ttft_ms']:.1f} ms, "
          f"p50 TPOT {m['median_tpot_ms']:.2f} ms ({len(per_leg['client TTFT'])} requests traced)\n")
    print("| leg | median ms | mean ms | p90 ms |")
    print("|---|---|---|---|")
    for key, values in per_leg.items():
        if values:
            p90 = sorted(values)[int(0.9 * (len(values) - 1))]
            print(f"| {key} | {statistics.median(values):.1f} | {statistics.fmean(values):.1f} | {p90:.1f} |")
    print()
    for key, value in figures.items():
        print(f"{key}: {value:.1f}" if isinstance(value, float) else f"{key}: {value}")
    shutil.rmtree(trace_dir, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Where a step's time goes: schedule, input preparation, forward, sampling, output processing.

    python benchmarks/step_overhead.py [--workloads W1 W2 smollm2] [--dtype float32] [--root bench_out/models]

For each workload it runs the offline engine (``LLM``, one process, the ``uni`` executor) on
the workload's prompts and times every step's phases by wrapping the methods that do them:

    phase           what is timed                                       side
    schedule        Scheduler.schedule                                  engine core (CPU)
    prepare         worker state update + ModelRunner._prepare_inputs   worker (CPU)
    forward         ModelRunner._forward (the model, logits)            device
    sample          ModelRunner._sample (sampler, logprobs)             device
    update          Scheduler.update_from_output                        engine core (CPU)
    detokenize      OutputProcessor.process_outputs                     front end (CPU)
    other           the rest of LLMEngine.step (glue, executor calls)

and prints per-step milliseconds, each phase's share of the step and the share of the step
spent outside the device phases (forward + sample): the overhead that asynchronous scheduling
and the engine-core process exist to hide. Every future change to the step loop is measured
against the device time it competes with.

Workloads: W1 and W2 are benchmarks/workloads.py's random-weight checkpoints (W1: 64 prompts x
128 in / 128 out; W2: 256 x 32 / 64); ``smollm2`` is SmolLM2-135M-Instruct's GGUF
(scripts/get_smollm2.sh), 64 prompts x 128 in / 128 out. Greedy, ignore_eos.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

PHASES = ("schedule", "prepare", "forward", "sample", "update", "detokenize", "other")
# name -> (num_prompts, input_len, output_len)
SHAPES = {"W1": (64, 128, 128), "W2": (256, 32, 64), "smollm2": (64, 128, 128)}


class PhaseTimer:
    """Accumulates wall time (and calls) per phase; ``wrap`` times one method of one class. ``durations`` keeps
    each call's seconds (for medians: a few long calls, e.g. the prompts' steps, skew the means)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.durations: dict[str, list[float]] = defaultdict(list)
        self.num_steps = 0
        self._restore: list[tuple[type, str, object]] = []

    def wrap(self, cls: type, method: str, phase: str) -> None:
        original = getattr(cls, method)
        seconds, calls, durations = self.seconds, self.calls, self.durations

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                seconds[phase] += took
                calls[phase] += 1
                durations[phase].append(took)

        self._restore.append((cls, method, original))
        setattr(cls, method, timed)

    def unwrap(self) -> None:
        for cls, method, original in reversed(self._restore):
            setattr(cls, method, original)
        self._restore.clear()


@contextmanager
def timed_engine(timer: PhaseTimer):
    from halserve.engine.llm_engine import LLMEngine
    from halserve.engine.output_processor import OutputProcessor
    from halserve.scheduler import Scheduler
    from halserve.worker import model_runner as mr

    timer.wrap(Scheduler, "schedule", "schedule")
    timer.wrap(Scheduler, "update_from_output", "update")
    timer.wrap(mr.ModelRunner, "_prepare_inputs", "prepare")
    timer.wrap(mr.ModelRunner, "_forward", "forward")
    timer.wrap(mr.ModelRunner, "_sample", "sample")
    timer.wrap(OutputProcessor, "process_outputs", "detokenize")
    # the worker's per-step state update (the step's diff) is input preparation too
    original_update = mr.update_states

    def update_states(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original_update(*args, **kwargs)
        finally:
            timer.seconds["prepare"] += time.perf_counter() - start

    mr.update_states = update_states
    original_step = LLMEngine.step

    def step(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original_step(self, *args, **kwargs)
        finally:
            timer.seconds["step"] += time.perf_counter() - start
            timer.num_steps += 1

    LLMEngine.step = step
    try:
        yield
    finally:
        LLMEngine.step = original_step
        mr.update_states = original_update
        timer.unwrap()


def model_path(name: str, root: str, gguf: str | None = None) -> str:
    if name == "smollm2" and gguf:
        return gguf
    if name == "smollm2":
        script = os.path.join(os.path.dirname(HERE), "scripts", "get_smollm2.sh")
        return subprocess.run(["bash", script], check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    from workloads import ensure_checkpoint

    return ensure_checkpoint(name, root)


def run_workload(name: str, args: argparse.Namespace) -> dict[str, float]:
    import random

    from halserve import LLM, SamplingParams

    num_prompts, input_len, output_len = SHAPES[name]
    if args.num_prompts:
        num_prompts = args.num_prompts
    path = model_path(name, args.root, args.gguf)
    llm = LLM(path, platform="cpu", dtype=args.dtype, enable_prefix_caching=False)
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(10, vocab - 1) for _ in range(input_len)]} for _ in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[: min(4, num_prompts)], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    timer = PhaseTimer()
    with timed_engine(timer):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    s = timer.seconds
    s["other"] = max(0.0, s["step"] - sum(s[p] for p in PHASES if p != "other"))
    result = {"wall_s": wall, "steps": timer.num_steps, "tok_s": generated / wall, **{p: s[p] for p in PHASES}, "step": s["step"]}
    del llm
    return result


def print_table(name: str, r: dict[str, float], dtype: str) -> None:
    steps = max(1, int(r["steps"]))
    step_ms = 1000 * r["step"] / steps
    device = r["forward"] + r["sample"]
    print(f"\n{name} ({dtype}): {int(r['steps'])} steps, {r['wall_s']:.2f} s, {r['tok_s']:.1f} output tok/s, "
          f"{step_ms:.2f} ms per step")
    print(f"  {'phase':<11} {'ms/step':>8} {'share':>7}")
    for p in PHASES:
        print(f"  {p:<11} {1000 * r[p] / steps:8.3f} {100 * r[p] / max(r['step'], 1e-9):6.1f}%")
    overhead = r["step"] - device
    print(f"  outside the device phases (forward + sample): {1000 * overhead / steps:.3f} ms/step = "
          f"{100 * overhead / max(r['step'], 1e-9):.1f}% of the step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["W1", "W2", "smollm2"], choices=list(SHAPES))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--root", default="bench_out/models", help="where W1/W2 checkpoints are written (once)")
    ap.add_argument("--num-prompts", type=int, default=None, help="override the workload's prompt count (smoke runs)")
    ap.add_argument("--gguf", default=None, help="smollm2: this GGUF file instead of scripts/get_smollm2.sh's Q4_1")
    args = ap.parse_args()
    import platform as _platform

    print(f"step overhead, {time.strftime('%Y-%m-%d')}, CPU: {_cpu_name()} ({_platform.machine()})")
    for name in args.workloads:
        print_table(name, run_workload(name, args), args.dtype)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()

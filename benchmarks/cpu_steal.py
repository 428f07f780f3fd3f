"""What other work on the engine's cores costs a decode step: the offline GGUF decode step (``gguf_levers.py
phases``: every stream decoding, one token a step) timed alone and next to a synthetic load that is busy for
``--busy-ms`` then sleeps for the rest of ``--period-ms`` (in a served load that other work is the API server's
detokenization and streaming and the load generator's parsing, which wake once a step).

    python benchmarks/cpu_steal.py                         # Q4_0, 16 streams, 2 ms busy every 9 ms, 2 rounds
    python benchmarks/cpu_steal.py --quant Q8_0 --streams 64 --busy-ms 1 --period-ms 5

The engine's kernels split each op's work evenly over its OpenMP threads and join at the op's end, so a thread
taken off its core stalls the other at the next join: the step grows by about the whole CPU time the load takes
(printed as ``x the load's busy time``), where two threads sharing the loss would grow it by half. Run under ``flock /tmp/cpu.lock`` on a shared machine.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# a busy-then-sleep loop on the wall clock (busy ms, period ms)
LOAD = """import sys, time
busy, period = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    time.sleep(max(0.0, period - busy))
"""


def step_ms(args: argparse.Namespace) -> float:
    """The median of gguf_levers.py phases' three timed runs: ms a decode step."""
    done = subprocess.run([sys.executable, os.path.join(HERE, "gguf_levers.py"), "phases", "--quant", args.quant,
                           "--streams", str(args.streams), "--prompt-len", "2"], capture_output=True, text=True)
    if done.returncode:
        sys.exit(done.stderr[-2000:])
    steps = [float(m) for m in re.findall(r"([0-9.]+) ms a step", done.stdout)]
    if not steps:
        sys.exit(f"no step times in gguf_levers.py's output:\n{done.stdout[-2000:]}")
    return sorted(steps)[len(steps) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quant", default="Q4_0")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--busy-ms", type=float, default=2.0)
    ap.add_argument("--period-ms", type=float, default=9.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if not 0 < args.busy_ms < args.period_ms:
        ap.error("need 0 < --busy-ms < --period-ms")
    share = args.busy_ms / args.period_ms
    print(f"{args.quant}, {args.streams} streams; the load: {args.busy_ms} ms busy every {args.period_ms} ms "
          f"({100 * share:.0f}% of one core)", flush=True)
    for r in range(args.rounds):
        alone = step_ms(args)
        load = subprocess.Popen([sys.executable, "-c", LOAD, str(args.busy_ms), str(args.period_ms)])
        try:
            loaded = step_ms(args)
        finally:
            load.kill()
            load.wait()
        # the load's CPU in one step's time: what the step would grow by if it only lost that time
        busy_per_step = share * loaded
        print(f"round {r}: {alone:.2f} ms a step alone, {loaded:.2f} with the load (+{loaded - alone:.2f} ms; "
              f"the load took {busy_per_step:.2f} ms of CPU in that time: "
              f"{(loaded - alone) / busy_per_step:.1f} x the load's busy time)", flush=True)


if __name__ == "__main__":
    main()

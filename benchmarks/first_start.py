"""What a first start costs on the CPU platform: seconds from a new process to the demo model's first
answer (``LLM(demo).generate("123+456=")``), with an empty kernel cache (``HALSERVE_KERNEL_CACHE`` a fresh
folder) and then again with the cache that start filled, for each install given, alternating them.

An editable install compiles the kernels the model needs on its first start; a wheel built with
``scripts/build_wheel.sh`` loads them prebuilt. Each child also reports how its kernels were obtained
(from the cpu_kernels build log: "using prebuilt ...", "built ... in N s", "using cached build").

  python benchmarks/first_start.py --install editable=python --install wheel=/tmp/hs_venv/bin/python --runs 2
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import time

CHILD = """
import json, logging, time
t0 = time.monotonic()
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
import halserve
from halserve import LLM, SamplingParams
from halserve.demo import DEMO_MODEL_PATH
llm = LLM(DEMO_MODEL_PATH, platform="cpu")
out = llm.generate(["123+456="], SamplingParams(max_tokens=8, temperature=0))
print("RESULT " + json.dumps({"text": out[0].outputs[0].text, "in_process_s": time.monotonic() - t0,
                               "halserve": halserve.__file__}))
"""


def run_once(python: str, cache: str) -> dict:
    env = dict(os.environ, HALSERVE_KERNEL_CACHE=cache)
    env.pop("HALSERVE_CPU_MARCH", None)
    started = time.monotonic()
    proc = subprocess.run([python, "-c", CHILD], env=env, capture_output=True, text=True, timeout=900)
    wall = time.monotonic() - started
    log = proc.stdout + proc.stderr
    if proc.returncode != 0 or "RESULT " not in proc.stdout:
        raise RuntimeError(f"{python} failed:\n{log[-3000:]}")
    result = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    built = re.findall(r"built halserve's native CPU kernels '(\w+)' in (\d+) s", log)
    prebuilt = re.findall(r"using prebuilt (\w+) kernels for torch \S+: halserve's native CPU kernels '(\w+)'", log)
    cached = re.findall(r"using cached build of halserve's native CPU kernels '(\w+)'", log)
    how = ([f"built {name} ({s} s)" for name, s in built] + [f"prebuilt {name} ({lvl})" for lvl, name in prebuilt]
           + [f"cached {name}" for name in cached])
    return dict(result, wall_s=wall, kernels=", ".join(how) or "none logged")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--install", action="append", required=True, metavar="NAME=PYTHON",
                        help="an install to time: a name and the python that has it")
    parser.add_argument("--runs", type=int, default=1, help="first starts per install (each with a new empty cache)")
    args = parser.parse_args()
    installs = [item.split("=", 1) for item in args.install]
    rows = []
    for run in range(args.runs):
        for name, python in installs:  # alternated, so drift on a shared machine hits both alike
            with tempfile.TemporaryDirectory(prefix="halserve-first-start-") as cache:
                first = run_once(python, cache)
                second = run_once(python, cache)
            rows.append((name, run, first, second))
            print(f"{name} run {run}: first start {first['wall_s']:.1f} s ({first['kernels']}), "
                  f"second start {second['wall_s']:.1f} s ({second['kernels']}); answer {first['text']!r}; "
                  f"{first['halserve']}", flush=True)
    print("\ninstall | first start (empty kernel cache) | second start | answer")
    for name, _, first, second in rows:
        print(f"{name} | {first['wall_s']:.1f} s | {second['wall_s']:.1f} s | {first['text']!r}")


if __name__ == "__main__":
    main()

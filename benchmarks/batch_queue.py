"""How long a multi-prompt ``/v1/completions`` takes while the engine is busy.

    python benchmarks/batch_queue.py [--model bench_out/models/W2] [--prompts 64] [--streams 32]

Starts ``halserve serve MODEL``, keeps ``--streams`` 200-token completions running (so the engine
core is stepping), then posts ``--repeats`` batches of ``--prompts`` four-token prompts with
``max_tokens=1`` and prints each batch's wall time: mostly the time to queue the batch, since its
prefill is one small step. (Issue 25: the batch's prompts used to reach the engine core one round
trip each, answered between steps.)
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def measure(url: str, prompts: int, streams: int, repeats: int) -> list[float]:
    async with httpx.AsyncClient(timeout=120) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]

        async def keep_busy() -> None:
            while True:
                await client.post(url + "/v1/completions", json={"model": model, "prompt": [5] * 32,
                                                                 "max_tokens": 200, "ignore_eos": True})

        load = [asyncio.create_task(keep_busy()) for _ in range(streams)]
        await asyncio.sleep(3)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            r = await client.post(url + "/v1/completions", json={
                "model": model, "prompt": [[7, 8, 9, 10 + i % 50] for i in range(prompts)], "max_tokens": 1})
            r.raise_for_status()
            times.append(time.perf_counter() - start)
            await asyncio.sleep(0.5)
        for task in load:
            task.cancel()
        return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                        "bench_out", "models", "W2"))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    port = free_port()
    log = open(os.path.join(tempfile.gettempdir(), "batch_queue_serve.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "halserve.entrypoints.cli", "serve", os.path.abspath(args.model),
                             "--port", str(port), "--dtype", "float32"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=tempfile.gettempdir())
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode}: see {log.name}")
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        times = asyncio.run(measure(url, args.prompts, args.streams, args.repeats))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    print(f"{args.prompts}-prompt batch, max_tokens=1, under {args.streams} streams: seconds "
          f"{[round(t, 3) for t in times]}, median {statistics.median(times):.3f}")


if __name__ == "__main__":
    main()

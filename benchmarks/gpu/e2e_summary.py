"""e2e.sh's last step: one table of every figure the steps wrote (JSON files in a folder), with the
halserve / transformers ratios, printed and saved as one JSON file.

    python benchmarks/gpu/e2e_summary.py JSON_DIR SUMMARY.json [--log e2e.log] [--device NAME]

A step that failed or was cut off leaves its file out; its rows say "missing".
"""
from __future__ import annotations

import argparse
import json
import os
import re


def _load(folder: str, name: str) -> dict | None:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _fmt(value: float | None, unit: str = "") -> str:
    return "missing" if value is None else f"{value:,.1f}{unit}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def summarize(folder: str, log: str | None = None) -> tuple[dict, list[str]]:
    lines: list[str] = []
    summary: dict = {"decode": [], "offline": [], "serve": None, "prefill_tflops": []}
    for size in ("small", "big"):
        ours, peer = _load(folder, f"halserve_{size}.json"), _load(folder, f"hf_{size}.json")
        lagged = _load(folder, f"halserve_{size}_async.json")  # the same rows with async scheduling, if run
        if ours is None:
            lines.append(f"halserve {size} model: missing (its step failed or was cut off)")
            continue
        label = ours["label"]
        hf_rows = {r["batch"]: r for r in (peer or {}).get("decode", [])}
        by_batch: dict[int, dict] = {}
        for row in ours["decode"] + (lagged or {}).get("decode", []):
            by_batch.setdefault(row["batch"], {"roofline": row["roofline_tokens_per_s"]})[row["mode"]] = row["tokens_per_s"]
        for batch, row in sorted(by_batch.items()):
            hf = hf_rows.get(batch, {}).get("tokens_per_s")
            entry = {"model": label, "batch": batch, "context": ours["decode"][0]["context"],
                     "graphs_tokens_per_s": row.get("graphs"), "eager_tokens_per_s": row.get("eager"),
                     "graphs_async_tokens_per_s": row.get("graphs+async"),
                     "roofline_tokens_per_s": row["roofline"], "transformers_tokens_per_s": hf}
            summary["decode"].append(entry)
            graphs = row.get("graphs")
            lines.append(
                f"decode {label:14s} batch {batch:3d} ctx {entry['context']}: graphs {_fmt(graphs)} tok/s, "
                f"eager {_fmt(row.get('eager'))} (graphs/eager {_ratio(graphs, row.get('eager'))}), "
                + (f"graphs+async {_fmt(row['graphs+async'])} ({_ratio(row['graphs+async'], graphs)} of graphs), "
                   if lagged is not None else "") + "roofline "
                f"{_fmt(row['roofline'])} ({_ratio(graphs, row['roofline'])} of it), transformers {_fmt(hf)} "
                f"(halserve/transformers {_ratio(graphs, hf)})")
        if ours.get("offline"):
            off, hf_off = ours["offline"], (peer or {}).get("offline")
            hf_tps = hf_off["output_tokens_per_s"] if hf_off else None
            summary["offline"].append({"model": label, **off, "transformers_output_tokens_per_s": hf_tps})
            lines.append(f"offline {label}: {off['prompts']} x {off['input_len']} in / {off['output_len']} out: "
                         f"{_fmt(off['output_tokens_per_s'])} output tok/s, transformers {_fmt(hf_tps)} "
                         f"(ratio {_ratio(off['output_tokens_per_s'], hf_tps)})")
    serve = _load(folder, "serve.json")
    if serve is not None:
        keep = {k: v for k, v in serve.items() if isinstance(v, (int, float))
                and any(s in k for s in ("ttft", "tpot", "throughput", "completed", "failed", "duration"))}
        summary["serve"] = keep
        pick = {k: keep.get(k) for k in keep if k.startswith(("mean_", "median_", "p99_")) or "throughput" in k}
        lines.append("serve: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(pick.items()) if v is not None))
    else:
        lines.append("serve: missing (its step failed or was cut off)")
    if log and os.path.isfile(log):
        with open(log, errors="replace") as f:
            found = [line.strip() for line in f if re.search(r"prefill.*TFLOP/s", line, re.IGNORECASE)]
        summary["prefill_tflops"] = found
        lines.extend(f"prefill kernel: {line}" for line in found)
    return summary, lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("out")
    p.add_argument("--log", default=None)
    p.add_argument("--device", default="")
    p.add_argument("--scale", default="full", help="'dry': tiny configs on a CPU (the figures mean nothing)")
    args = p.parse_args()
    summary, lines = summarize(args.folder, args.log)
    summary.update(device=args.device, scale=args.scale)
    print(f"===== e2e summary ({args.device}{', DRY RUN: tiny configs, CPU' if args.scale == 'dry' else ''})")
    print("\n".join(lines))
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()

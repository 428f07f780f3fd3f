"""Quantized copies of a workload checkpoint (BENCHMARKS.md, "Quantized checkpoints").

    python benchmarks/quantized_workloads.py bench_out/W1 bench_out [FORMAT ...]

writes ``bench_out/W1-<FORMAT>`` for each FORMAT (default all):

    gptq        GPTQ v1, 4-bit, symmetric (what vLLM's CPU build takes), group 128, act-order off
    awq         AutoAWQ GEMM, 4-bit, group 128
    w4a16       compressed-tensors W4A16 (symmetric, group 128), written by compressed-tensors
    w8a8        compressed-tensors W8A8 int8 (per-channel weights, dynamic per-token activations)
    fp8         compressed-tensors FP8_DYNAMIC (per-channel weights, dynamic per-token activations)

Round-to-nearest quantization of the random weights (the tests' factory, ``tests/quant_factory.py``):
the figures are about speed, not accuracy.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import quant_factory as qf  # noqa: E402

FORMATS = {
    "gptq": lambda base, out: qf.make_gptq_checkpoint(base, out, group_size=128, sym=True),
    "awq": lambda base, out: qf.make_awq_checkpoint(base, out, group_size=128),
    "w4a16": lambda base, out: qf.make_ct_checkpoint(base, out, "W4A16", group_size=128),
    "w8a8": lambda base, out: qf.make_ct_checkpoint(base, out, "W8A8"),
    "fp8": lambda base, out: qf.make_ct_checkpoint(base, out, "FP8_DYNAMIC"),
}


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    base, root, names = sys.argv[1], sys.argv[2], sys.argv[3:] or list(FORMATS)
    for name in names:
        if name not in FORMATS:
            sys.exit(f"unknown format {name!r}; formats: {', '.join(FORMATS)}")
        out = os.path.join(root, f"{os.path.basename(os.path.normpath(base))}-{name}")
        FORMATS[name](base, out)
        print(name, out)


if __name__ == "__main__":
    main()

"""Host cost of prompt-lookup proposals per request and step (BENCHMARKS.md).

    python benchmarks/ngram_proposer.py

For sequences of 256 to 32k tokens: random tokens (few matches), and a 3-token loop (every
position a candidate: the worst case), each proposed for with the scheduler's per-request key
(the numpy copy kept between steps) and without it (a fresh array per call).
"""
from __future__ import annotations

import time

import numpy as np

from halserve.spec_decode import NgramProposer


def per_call_ms(proposer: NgramProposer, tokens: list[int], key: str | None, repeats: int = 50) -> float:
    proposer.propose(tokens, key=key)  # (fills the keyed buffer, as the steps before would have)
    start = time.perf_counter()
    for _ in range(repeats):
        proposer.propose(tokens, key=key)
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    rng = np.random.default_rng(0)
    proposer = NgramProposer(1, 4, 4)
    print("tokens  sequence  keyed ms  fresh ms")
    for length in (256, 4096, 32768):
        for name, tokens in (("random", rng.integers(0, 32000, length).tolist()), ("loop", [5, 6, 7] * (length // 3))):
            keyed = per_call_ms(proposer, tokens, key=f"{name}{length}")
            fresh = per_call_ms(proposer, tokens, key=None)
            print(f"{length:6d}  {name:8s}  {keyed:8.3f}  {fresh:8.3f}")


if __name__ == "__main__":
    main()

"""Prompt-lookup (n-gram) drafts: continue the sequence as it continued the last time its
current ending occurred (vLLM's ``ngram`` method).

    tokens:  ... a b c d e ... x y  a b c        suffix "a b c" (n = 3) occurred before,
                       ^^^^^^^^^^^^              followed by "d e ... ": propose those

The longest ``n`` in ``[min_n, max_n]`` with an earlier occurrence wins; among its
occurrences, the latest one (nearest context) followed by a full ``k`` tokens does, else the
earliest (the longest continuation: in a loop like "x y x y x y" the latest occurrence is
followed by only a token or two, any earlier one by as many as the loop gives). Pure numpy
on the host, O(len * n).
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    from_worker = False  # (the scheduler calls ``propose``)
    def __init__(self, min_n: int, max_n: int, num_speculative_tokens: int,
                 disable_by_batch_size: int | None = None) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.num_speculative_tokens = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size  # (the scheduler's: no drafts for batches this big)

    def propose(self, token_ids: list[int], max_num_tokens: int | None = None) -> list[int]:
        """Draft tokens to follow ``token_ids`` (prompt + outputs), at most
        ``min(num_speculative_tokens, max_num_tokens)``; [] when no suffix recurs."""
        k = self.num_speculative_tokens if max_num_tokens is None else min(self.num_speculative_tokens, max_num_tokens)
        num_tokens = len(token_ids)
        if k <= 0 or num_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            suffix = tokens[num_tokens - n :]
            # windows starting at 0 .. num_tokens - n - 1: every earlier occurrence (not the suffix itself)
            windows = sliding_window_view(tokens[: num_tokens - 1], n)  # [num_tokens - n, n]
            starts = np.flatnonzero((windows == suffix).all(axis=1))
            if starts.size:
                full = starts[starts + n + k <= num_tokens]  # occurrences followed by k tokens
                follow = int(full[-1] if full.size else starts[0]) + n  # first token after the occurrence
                return tokens[follow : follow + k].tolist()
        return []

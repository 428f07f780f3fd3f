"""Multi-step paged-attention scenarios shared by the isolated suites.

A scenario is a list of steps; each step schedules some new tokens for some requests,
in a given order (decodes and prefills interleaved on purpose). Requests own blocks
drawn from a shuffled pool; a request may start on a *prefix hit*: its first blocks are
another request's blocks, already written, so its first step is a chunked prefill over
cached context. Every backend under test keeps its OWN cache (layouts differ) and fills
it through its own ``forward``; each step's outputs are compared with a dense float64
reference computed from the K/V history, independent of any cache.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

from halserve.attention_backends.base import AttentionMetadata


@dataclass
class Req:
    blocks: list[int] = field(default_factory=list)
    k: list[torch.Tensor] = field(default_factory=list)  # per position [KVH, D]
    v: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.k)


@dataclass
class Step:
    q: torch.Tensor  # [T, H, D] float32 (cast by the caller)
    k: torch.Tensor  # [T, KVH, D]
    v: torch.Tensor
    metadata: AttentionMetadata  # CPU tensors
    expected: torch.Tensor  # [T, H, D] float64 dense reference


class Scenario:
    def __init__(self, *, num_heads: int, num_kv_heads: int, head_size: int, block_size: int, num_blocks: int,
                 sliding_window: int | None = None, soft_cap: float | None = None, seed: int = 0,
                 max_blocks_per_req: int | None = None):
        self.h, self.kvh, self.d, self.bs = num_heads, num_kv_heads, head_size, block_size
        self.num_blocks = num_blocks
        self.window, self.soft_cap = sliding_window, soft_cap
        self.scale = head_size ** -0.5
        self.gen = torch.Generator().manual_seed(seed)
        pool = list(range(1, num_blocks))  # block 0 is the null block padding block tables
        random.Random(seed).shuffle(pool)
        self.free = pool
        self.reqs: dict[str, Req] = {}
        self.max_blocks_per_req = max_blocks_per_req

    def add(self, name: str, prefix_of: str | None = None, prefix_blocks: int = 0) -> None:
        req = Req()
        if prefix_of is not None:
            src = self.reqs[prefix_of]
            assert src.num_tokens >= prefix_blocks * self.bs, "prefix blocks must be full and written"
            req.blocks = src.blocks[:prefix_blocks]
            req.k = src.k[: prefix_blocks * self.bs]
            req.v = src.v[: prefix_blocks * self.bs]
        self.reqs[name] = req

    def step(self, schedule: list[tuple[str, int]]) -> Step:
        """``schedule``: (request, number of new tokens) in batch order."""
        qs, ks, vs, slots, qsl, seq_lens, expected = [], [], [], [], [0], [], []
        for name, n in schedule:
            req = self.reqs[name]
            start = req.num_tokens
            need = math.ceil((start + n) / self.bs)
            while len(req.blocks) < need:
                req.blocks.append(self.free.pop())
            q = torch.randn(n, self.h, self.d, generator=self.gen)
            k = torch.randn(n, self.kvh, self.d, generator=self.gen)
            v = torch.randn(n, self.kvh, self.d, generator=self.gen)
            req.k.extend(k.unbind(0))
            req.v.extend(v.unbind(0))
            for i in range(n):
                pos = start + i
                slots.append(req.blocks[pos // self.bs] * self.bs + pos % self.bs)
            qs.append(q), ks.append(k), vs.append(v)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            expected.append(self._dense(q, torch.stack(req.k), torch.stack(req.v), start))
        max_blocks = self.max_blocks_per_req or max(len(self.reqs[name].blocks) for name, _ in schedule)
        block_table = torch.zeros(len(schedule), max_blocks, dtype=torch.int32)
        for r, (name, _) in enumerate(schedule):
            blocks = self.reqs[name].blocks
            block_table[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        seq_t = torch.tensor(seq_lens, dtype=torch.int32)
        md = AttentionMetadata(
            num_actual_tokens=qsl[-1], num_reqs=len(schedule), max_query_len=max(n for _, n in schedule),
            max_seq_len=max(seq_lens), query_start_loc=qsl_t.clone(), seq_lens=seq_t.clone(),
            block_table=block_table, slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc_cpu=qsl_t, seq_lens_cpu=seq_t,
        )
        return Step(torch.cat(qs), torch.cat(ks), torch.cat(vs), md, torch.cat(expected))

    def _dense(self, q, k, v, context_len):
        """q [n, H, D], k/v [L, KVH, D] -> [n, H, D] float64 (causal, window, soft cap)."""
        group = self.h // self.kvh
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        s = torch.einsum("nhd,lhd->hnl", q.double(), k) * self.scale
        if self.soft_cap:
            s = torch.tanh(s / self.soft_cap) * self.soft_cap
        q_pos = torch.arange(context_len, context_len + q.shape[0]).unsqueeze(1)
        k_pos = torch.arange(k.shape[0]).unsqueeze(0)
        visible = k_pos <= q_pos
        if self.window:
            visible &= k_pos > q_pos - self.window
        s = s.masked_fill(~visible, float("-inf"))
        return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


def metadata_to(md: AttentionMetadata, device) -> AttentionMetadata:
    """The same step with device tensors on ``device`` (host copies stay on the CPU)."""
    return AttentionMetadata(
        num_actual_tokens=md.num_actual_tokens, num_reqs=md.num_reqs, max_query_len=md.max_query_len,
        max_seq_len=md.max_seq_len, query_start_loc=md.query_start_loc.to(device), seq_lens=md.seq_lens.to(device),
        block_table=md.block_table.to(device), slot_mapping=md.slot_mapping.to(device),
        query_start_loc_cpu=md.query_start_loc_cpu, seq_lens_cpu=md.seq_lens_cpu,
    )


# Tolerances against the float64 reference, per compute dtype.
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


MIXED_STEPS = [
    [("a", 20), ("b", 5)],  # two first prefills (a: 1 full block + 4)
    [("b", 1), ("a", 17)],  # decode, then a 17-token chunk over 20 cached tokens
    [("a", 1), ("c", 9), ("b", 1)],  # c hits a's first 2 blocks (32 cached tokens): chunk of 9; decodes around it
    [("d", 1), ("c", 1), ("a", 1), ("e", 3)],  # a 1-token prefill, decodes, a short prefill
    [("c", 1), ("e", 30), ("a", 1), ("b", 1), ("d", 1)],  # interleaved again; e crosses blocks
]


def mixed_scenario(sc: Scenario):
    """The MIXED_STEPS schedule; c starts on a prefix hit of a's first two blocks."""
    sc.add("a")
    sc.add("b")
    for i, schedule in enumerate(MIXED_STEPS):
        if i == 2:
            sc.add("c", prefix_of="a", prefix_blocks=2)
        if i == 3:
            sc.add("d")
            sc.add("e")
        yield sc.step(schedule)

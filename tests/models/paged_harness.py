"""A minimal stand-in for the model runner: a shuffled block pool, per-request block
tables and hand-built AttentionMetadata, to drive a halserve model step by step."""
from __future__ import annotations

import math
import random

import torch

from halserve.attention_backends.base import AttentionMetadata
from halserve.forward_context import set_forward_context


class PagedHarness:
    def __init__(self, model, backend_cls, *, num_blocks: int = 128, block_size: int = 4, seed: int = 0,
                 cache_dtype: torch.dtype = torch.float32) -> None:
        self.model, self.backend_cls, self.block_size = model, backend_cls, block_size
        for layer in model.attention_layers:
            shape = backend_cls.kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_size)
            layer.kv_cache = torch.zeros(shape, dtype=cache_dtype)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # non-contiguous block tables
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(self, batch: list[tuple[str, list[int]]], inputs_embeds: torch.Tensor | None = None,
             positions: torch.Tensor | None = None) -> torch.Tensor:
        """Schedule ``(request_id, new_token_ids)`` pairs as one flattened step; returns
        float32 logits for every scheduled token [T, vocab]. ``inputs_embeds`` [T, H]: run the
        model on these instead of the tokens' embeddings (a multimodal prompt's). ``positions``
        ([T], or M-RoPE's [3, T]): the model's positions instead of each token's index in its request
        (the KV-cache slots still follow the index)."""
        ids, indices, slots, starts, seq_lens, tables = [], [], [], [0], [], []
        for req, tokens in batch:
            ctx = self.lens.get(req, 0)
            table = self.tables.setdefault(req, [])
            seq_len = ctx + len(tokens)
            while len(table) < math.ceil(seq_len / self.block_size):
                table.append(self.free.pop())
            for i, tok in enumerate(tokens):
                pos = ctx + i
                ids.append(tok)
                indices.append(pos)
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            self.lens[req] = seq_len
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(seq_len)
            tables.append(table)
        width = max(len(t) for t in tables)
        block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        qsl = torch.tensor(starts, dtype=torch.int32)
        sl = torch.tensor(seq_lens, dtype=torch.int32)
        common = AttentionMetadata(
            num_actual_tokens=len(ids), num_reqs=len(batch), max_query_len=max(len(t) for _, t in batch),
            max_seq_len=max(seq_lens), query_start_loc=qsl, seq_lens=sl, block_table=block_table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_cpu=qsl, seq_lens_cpu=sl,
        )
        meta = self.backend_cls.build_metadata(common)
        model_positions = torch.tensor(indices) if positions is None else positions
        with torch.no_grad(), set_forward_context(meta):
            if inputs_embeds is None:
                hidden = self.model(torch.tensor(ids), model_positions)
            else:
                hidden = self.model(torch.tensor(ids), model_positions, inputs_embeds=inputs_embeds)
            return self.model.compute_logits(hidden)

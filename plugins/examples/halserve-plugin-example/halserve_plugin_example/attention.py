"""``example_attn``: paged attention written from the halserve contract, not from the reference.

Cache layout: halserve's default, ``[2, num_blocks, block_size, num_kv_heads, head_size]``
(0 = keys, 1 = values). Per step: write every new token's K/V at ``slot_mapping``, then
for each request gather its context through ``block_table`` and attend, causally: query i
of a request sits at position ``seq_len - query_len + i`` and sees keys ``<=`` that position
(and ``> position - sliding_window`` when a window is set).
"""
from __future__ import annotations

from halserve.attention_backends.base import AttentionBackend


class ExampleAttentionBackend(AttentionBackend):
    name = "example_attn"
    platforms = ("example", "cpu")
    dtypes = ("float32", "float16", "bfloat16")
    kv_cache_dtypes = ("auto",)
    supports_sliding_window = True
    supports_logits_soft_cap = False
    description = "per-request gather + matmul/softmax in fp32 (example device)"

    def forward(self, q, k, v, kv_cache, metadata, k_scale: float = 1.0, v_scale: float = 1.0):
        import torch

        n = metadata.num_actual_tokens
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # [num_blocks, B, Hk, D]
        block_size = key_cache.shape[1]
        slots = metadata.slot_mapping[:n].long()
        key_cache.view(-1, self.num_kv_heads, self.head_size)[slots] = k[:n].to(key_cache.dtype)
        value_cache.view(-1, self.num_kv_heads, self.head_size)[slots] = v[:n].to(value_cache.dtype)

        out = torch.zeros_like(q)
        group = self.num_heads // self.num_kv_heads
        starts = metadata.query_start_loc_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        for r in range(metadata.num_reqs):
            start, end, seq_len = starts[r], starts[r + 1], seq_lens[r]
            if end == start:
                continue
            num_blocks = -(-seq_len // block_size)
            blocks = metadata.block_table[r, :num_blocks].long()
            keys = key_cache[blocks].flatten(0, 1)[:seq_len].float()  # [L, Hk, D]
            values = value_cache[blocks].flatten(0, 1)[:seq_len].float()
            keys = keys.repeat_interleave(group, dim=1)  # [L, Hq, D]
            values = values.repeat_interleave(group, dim=1)
            query = q[start:end].float()  # [Lq, Hq, D]
            scores = torch.einsum("qhd,khd->hqk", query, keys) * self.scale  # [Hq, Lq, L]
            q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)[:, None]
            k_pos = torch.arange(seq_len, device=q.device)[None, :]
            visible = k_pos <= q_pos
            if self.sliding_window is not None:
                visible &= k_pos > q_pos - self.sliding_window
            scores = scores.masked_fill(~visible, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
        return out

"""The ``fused_moe`` torch reference (the registered kernel) against a per-token loop."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from halserve.kernels import resolve_kernel


def per_token_moe(hidden, w13, w2, topk_weights, topk_ids):
    """The op's definition spelled out one (token, chosen expert) pair at a time, in float32."""
    inter = w2.shape[2]
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for t in range(hidden.shape[0]):
        x = hidden[t].float()
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate, up = w13[e, :inter].float() @ x, w13[e, inter:].float() @ x
            out[t] += float(topk_weights[t, j]) * (w2[e].float() @ (F.silu(gate) * up))
    return out.to(hidden.dtype)


def moe_inputs(num_tokens, num_experts, top_k, hidden, inter, used_experts, dtype, seed=0):
    """Random inputs whose tokens only pick among ``used_experts`` (the others get no tokens)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    used = torch.tensor(used_experts)
    choice = torch.rand(num_tokens, len(used_experts), generator=g).argsort(dim=-1)[:, :top_k]
    topk_ids = used[choice]  # distinct experts per token
    topk_weights = torch.rand(num_tokens, top_k, generator=g).softmax(dim=-1)
    return x, w13, w2, topk_weights, topk_ids


@pytest.mark.parametrize("num_tokens,num_experts,top_k,used,dtype,tol", [
    (7, 8, 2, [1, 2, 5, 6], torch.float32, 1e-5),  # experts 0, 3, 4, 7 get no tokens
    (5, 4, 1, [0, 1, 2, 3], torch.float32, 1e-5),
    (9, 6, 3, [0, 2, 3, 5], torch.bfloat16, 2e-2),
    (1, 8, 2, [3, 7], torch.float32, 1e-5),
    (0, 4, 2, [0, 1], torch.float32, 0.0),  # an empty step
])
def test_reference_matches_per_token_loop(num_tokens, num_experts, top_k, used, dtype, tol):
    hidden, inter = 32, 24
    kernel = resolve_kernel("fused_moe", "cpu", dtype=str(dtype).replace("torch.", ""), num_experts=num_experts,
                            top_k=top_k, hidden_size=hidden, intermediate_size=inter)
    args = moe_inputs(num_tokens, num_experts, top_k, hidden, inter, used, dtype)
    got = kernel(*args)
    want = per_token_moe(*args)
    assert got.shape == (num_tokens, hidden) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    if num_tokens:
        assert got.abs().max() > 0.1  # the inputs are not degenerate


def test_unused_experts_do_not_matter():
    """Experts that receive no token are never read: poisoning them changes nothing."""
    kernel = resolve_kernel("fused_moe", "cpu", dtype="float32", num_experts=8, top_k=2, hidden_size=32,
                            intermediate_size=24)
    x, w13, w2, topk_weights, topk_ids = moe_inputs(6, 8, 2, 32, 24, [0, 4, 5], torch.float32)
    want = kernel(x, w13, w2, topk_weights, topk_ids)
    for unused in (1, 2, 3, 6, 7):
        w13[unused] = float("nan")
        w2[unused] = float("nan")
    torch.testing.assert_close(kernel(x, w13, w2, topk_weights, topk_ids), want, atol=0, rtol=0)

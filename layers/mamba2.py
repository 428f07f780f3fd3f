"""Mamba2's mixer (the recurrent layers of Bamba, Granite 4 and Nemotron-H) on the flattened batch, with
each request's conv and SSM state kept in KV-cache pages (``halserve.kv_cache.spec.MambaSpec``).

Per token t of a request (Hm heads of P channels, G groups of B/C of N values, head h reads group
g(h) = h // (Hm / G); I = Hm * P)::

    z [I], xBC [I + 2 G N], dt [Hm] = in_proj(u_t)
    xBC_t = silu(conv1d(xBC_{t-K+1} .. xBC_t) + bias)      conv state: the last K - 1 inputs
    x [Hm, P], B [G, N], C [G, N] = split(xBC_t)
    dt = clamp(softplus(dt + dt_bias), time_step_limit);  A = -exp(A_log)
    S_h <- exp(dt_h A_h) S_h + dt_h x_h B_g(h)^T            SSM state S [Hm, P, N]
    y_h = S_h C_g(h) + D_h x_h
    out = out_proj(rmsnorm_per_group(y * silu(z)) * norm.weight)      (groups of I / G channels)

A prefill chunk starts from the state the request's previous chunk left (zeros at position 0) and
leaves its own; a decode step is a chunk of one token. The scan here is sequential over a step's
positions and batched over its requests: the torch reference (transformers' chunked SSD computes the
same recurrence in another order).

State in the pages: the group's block table row of request r starts with its ``num_state_blocks``
blocks; their keys then their values (``kv_cache_block_views``) are one flat run of elements::

    | conv state [conv_dim, K - 1] | SSM state [Hm, P, N] | (unused tail) |
      keys of blk 5, keys of blk 6 ...     values of blk 5, values of blk 6 ...
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from halserve.forward_context import get_forward_context
from halserve.kv_cache.spec import MambaSpec
from halserve.layers.context import ModelContext
from halserve.layers.linear import ReplicatedLinear


class GatedRMSNorm(nn.Module):
    """``rmsnorm(x * silu(gate))`` over groups of ``group_size`` channels, times ``weight`` (in float32)."""

    def __init__(self, hidden_size: int, group_size: int, eps: float, ctx: ModelContext) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=ctx.dtype), requires_grad=False)
        self.group_size, self.eps = group_size, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # x, gate [T, I] -> [T, I] float32
        h = x.float() * F.silu(gate.float())
        groups = h.view(*h.shape[:-1], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.float() * groups.view_as(h)


class MambaMixer2(nn.Module):
    """One Mamba2 layer (one tensor-parallel rank holds all of it).

    Attributes the model runner sets after building the model (as on ``Attention``):
        kv_cache         the tensor of its slot in the pool (an attention layer's layout)
        kv_cache_group   its KV-cache group: the step's metadata is one per group, it reads its own
        page_views       kv_cache -> (keys, values), each [num_blocks, ...] (the backend's
                         ``kv_cache_block_views``), the pages its state is written into
    """

    def __init__(self, *, hidden_size: int, num_heads: int, head_dim: int, num_groups: int, state_size: int,
                 conv_kernel: int, use_conv_bias: bool, use_bias: bool, eps: float,
                 time_step_limit: tuple[float, float], page_token_elements: int, ctx: ModelContext,
                 prefix: str) -> None:
        super().__init__()
        if num_heads % num_groups:
            raise ValueError(f"{prefix}: mamba_n_heads ({num_heads}) must be a multiple of mamba_n_groups ({num_groups})")
        if ctx.kv_cache_dtype != "auto":
            raise ValueError(f"{prefix}: a Mamba2 state is kept in the KV cache's dtype; kv_cache_dtype "
                             f"{ctx.kv_cache_dtype!r} would round it every step: use kv_cache_dtype='auto'")
        self.prefix = prefix
        self.num_heads, self.head_dim, self.num_groups, self.state_size = num_heads, head_dim, num_groups, state_size
        self.conv_kernel = conv_kernel
        self.intermediate_size = num_heads * head_dim
        self.conv_dim = self.intermediate_size + 2 * num_groups * state_size
        self.time_step_limit = time_step_limit
        self.page_token_elements = page_token_elements
        self.in_proj = ctx.layer(ReplicatedLinear)(hidden_size, self.intermediate_size + self.conv_dim + num_heads,
                                                   use_bias, ctx, f"{prefix}.in_proj")
        # (the checkpoint's conv1d.weight [conv_dim, 1, K] and conv1d.bias: a depthwise conv)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, conv_kernel, dtype=ctx.dtype),
                                          requires_grad=False)
        self.conv1d.bias = (nn.Parameter(torch.zeros(self.conv_dim, dtype=ctx.dtype), requires_grad=False)
                            if use_conv_bias else None)
        self.dt_bias = nn.Parameter(torch.ones(num_heads, dtype=ctx.dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(num_heads, dtype=ctx.dtype), requires_grad=False)
        self.D = nn.Parameter(torch.ones(num_heads, dtype=ctx.dtype), requires_grad=False)
        self.norm = GatedRMSNorm(self.intermediate_size, self.intermediate_size // num_groups, eps, ctx)
        self.out_proj = ctx.layer(ReplicatedLinear)(self.intermediate_size, hidden_size, use_bias, ctx,
                                                    f"{prefix}.out_proj")
        self.kv_cache = torch.empty(0)
        self.kv_cache_group: int | None = None
        self.page_views: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def kv_cache_spec(self) -> MambaSpec:
        return MambaSpec((self.conv_dim, self.conv_kernel - 1), (self.num_heads, self.head_dim, self.state_size),
                         self.page_token_elements)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [T, H] -> [T, H]
        metadata = get_forward_context().attn_metadata
        projected = self.in_proj(hidden)  # [T, I + conv_dim + Hm]
        if metadata is None:  # dummy run (warm-up): no state to read or write
            return self.out_proj(projected[:, : self.intermediate_size])
        if self.kv_cache_group is not None:
            metadata = metadata[self.kv_cache_group]
        if self.kv_cache.numel() == 0 or self.page_views is None:
            raise RuntimeError(f"Mamba2 layer {self.prefix!r} has no kv_cache; the model runner must set it")
        num_tokens = metadata.num_actual_tokens
        z, xbc, dt = projected[:num_tokens].split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        y = self._mix(xbc, dt, metadata)  # [T, I] float32
        out = self.out_proj(self.norm(y, z).to(hidden.dtype))
        if num_tokens < hidden.shape[0]:  # (padded rows past the step's tokens)
            out = torch.cat([out, out.new_zeros(hidden.shape[0] - num_tokens, out.shape[1])])
        return out

    def _mix(self, xbc: torch.Tensor, dt: torch.Tensor, metadata: Any) -> torch.Tensor:
        """Conv + SSM over each request's tokens of this step, from and back to its state in the pages."""
        dev = xbc.device
        query_start = metadata.query_start_loc_cpu.tolist()
        num_reqs = metadata.num_reqs
        query_lens = torch.tensor([query_start[r + 1] - query_start[r] for r in range(num_reqs)], device=dev)
        starts = metadata.seq_lens_cpu[:num_reqs].to(dev) - query_lens  # tokens computed before the step
        max_len = int(query_lens.max())
        # the step's tokens as [R, L] (padding repeats a request's last token; masked by `valid`)
        offsets = torch.arange(max_len, device=dev)
        valid = offsets[None, :] < query_lens[:, None]  # [R, L]
        index = torch.tensor(query_start[:num_reqs], device=dev)[:, None] + torch.minimum(offsets[None, :],
                                                                                           query_lens[:, None] - 1)
        conv_state, ssm_state, state_ids = self._read_states(metadata.block_table[:num_reqs], starts == 0)

        # causal depthwise conv over [conv state | the step's inputs]
        inputs = xbc.float()[index].masked_fill(~valid[..., None], 0.0).transpose(1, 2)  # [R, conv_dim, L]
        window = torch.cat([conv_state, inputs], dim=2)  # [R, conv_dim, K - 1 + L]
        weight = self.conv1d.weight.float()
        bias = None if self.conv1d.bias is None else self.conv1d.bias.float()
        xbc_conv = F.silu(F.conv1d(window, weight, bias, groups=self.conv_dim)).transpose(1, 2)  # [R, L, conv_dim]
        # the new conv state: the last K - 1 inputs of each request, window[:, :, q_r : q_r + K - 1]
        last = (query_lens[:, None] + torch.arange(self.conv_kernel - 1, device=dev)[None, :])
        conv_state = window.gather(2, last[:, None, :].expand(-1, self.conv_dim, -1))

        hm, p, n, g = self.num_heads, self.head_dim, self.state_size, self.num_groups
        x, b, c = xbc_conv.split([self.intermediate_size, g * n, g * n], dim=-1)
        x = x.reshape(num_reqs, max_len, hm, p)
        b = b.reshape(num_reqs, max_len, g, n).repeat_interleave(hm // g, dim=2)  # [R, L, Hm, N]
        c = c.reshape(num_reqs, max_len, g, n).repeat_interleave(hm // g, dim=2)
        step_dt = F.softplus(dt.float()[index] + self.dt_bias.float())  # [R, L, Hm]
        step_dt = step_dt.clamp(self.time_step_limit[0], self.time_step_limit[1])
        decay = torch.exp(step_dt * -torch.exp(self.A_log.float()))  # [R, L, Hm]
        d = self.D.float()[:, None]
        y = torch.empty(num_reqs, max_len, hm, p, device=dev)
        for i in range(max_len):  # the recurrence, one position of every request at a time
            new_state = (ssm_state * decay[:, i, :, None, None]
                         + (step_dt[:, i, :, None] * x[:, i])[..., None] * b[:, i, :, None, :])  # [R, Hm, P, N]
            ssm_state = torch.where(valid[:, i, None, None, None], new_state, ssm_state)
            y[:, i] = (ssm_state * c[:, i, :, None, :]).sum(-1) + d * x[:, i]
        self._write_states(state_ids, conv_state, ssm_state)
        return y.reshape(num_reqs, max_len, -1)[valid]  # [T, I], requests' tokens in order

    # -- the state in the pages ----------------------------------------------------------
    def _state_layout(self) -> tuple[int, int]:
        return self.conv_dim * (self.conv_kernel - 1), self.num_heads * self.head_dim * self.state_size

    def _read_states(self, block_table: torch.Tensor, is_fresh: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each request's (conv [R, conv_dim, K - 1], SSM [R, Hm, P, N]) state in float32, zeros for a
        request at position 0, and its state's block ids [R, num_state_blocks]."""
        keys, values = self.page_views(self.kv_cache)
        per_block = math.prod(keys.shape[1:])
        num_conv, num_ssm = self._state_layout()
        num_blocks = -(-(num_conv + num_ssm) // (2 * per_block))
        state_ids = block_table[:, :num_blocks].to(device=keys.device, dtype=torch.long)  # [R, k]
        num_reqs = state_ids.shape[0]
        flat = torch.cat([keys[state_ids].reshape(num_reqs, -1), values[state_ids].reshape(num_reqs, -1)], dim=1)
        flat = flat.float().masked_fill(is_fresh.to(flat.device)[:, None], 0.0)
        conv = flat[:, :num_conv].reshape(num_reqs, self.conv_dim, self.conv_kernel - 1)
        ssm = flat[:, num_conv : num_conv + num_ssm].reshape(num_reqs, self.num_heads, self.head_dim, self.state_size)
        return conv, ssm, state_ids

    def _write_states(self, state_ids: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        keys, values = self.page_views(self.kv_cache)
        num_reqs, num_blocks = state_ids.shape
        half = num_blocks * math.prod(keys.shape[1:])
        flat = torch.zeros(num_reqs, 2 * half, dtype=keys.dtype, device=keys.device)
        num_conv, num_ssm = self._state_layout()
        flat[:, :num_conv] = conv.reshape(num_reqs, -1)
        flat[:, num_conv : num_conv + num_ssm] = ssm.reshape(num_reqs, -1)
        keys[state_ids] = flat[:, :half].reshape(num_reqs, num_blocks, *keys.shape[1:])
        values[state_ids] = flat[:, half:].reshape(num_reqs, num_blocks, *values.shape[1:])

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, head_dim={self.head_dim}, groups={self.num_groups}, "
                f"state={self.state_size}, conv={self.conv_kernel}")

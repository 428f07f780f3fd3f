"""Qwen2-VL's and Qwen2.5-VL's vision towers with their patch mergers (what transformers'
``Qwen2VisionTransformerPretrainedModel`` / ``Qwen2_5_VisionTransformerPretrainedModel`` return as
``pooler_output``), for any number of images of any sizes in one call.

    pixel_values [P, C * Tp * p * p]   every image's patches, one after another (the image processor's
                                       order: m x m merge blocks, row-major inside and across them)
    grid_thw [N, 3]                    each image's (t, h, w) in patches: P = sum of t * h * w
      patch_embed (Conv3d, stride = kernel, no bias: one matmul)               [P, D]
      rotary: 2D rope on the patch's (row, column): D/heads/4 frequencies each
      blocks: pre-norm attention + MLP; a patch attends to the patches of its own image (frame)
              Qwen2.5-VL: of its own window (window_size pixels square), except in fullatt_block_indexes
      merger: norm, each m x m merge block's D-vectors concatenated [P / m^2, m^2 D] -> Linear -> GELU
              -> Linear                                                       [P / m^2, out_hidden]

    differences         Qwen2-VL (2)                    Qwen2.5-VL (2.5)
    width D             embed_dim                       hidden_size
    merger output       hidden_size                     out_hidden_size
    norms               LayerNorm (eps 1e-6)            RMSNorm (eps 1e-6)
    MLP                 fc1 -> hidden_act -> fc2        down(act(gate) * up), biased
    attention           whole image                     windows, whole image in fullatt_block_indexes

Qwen2.5-VL's windows are squares of ``window_size // patch_size // m`` merged tokens (the last ones in a
row or column smaller); the patches are reordered window by window before the blocks (their rope
angles with them) and the merged tokens put back in image order after the merger.

Plain torch modules in the model dtype, replicated on every tensor-parallel rank (no sharding,
quantization or LoRA); rope and the attention softmax in float32 as transformers does.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from halserve.layers import ModelContext
from halserve.layers.linear import vision_linear
from halserve.models.vision_layers import VisionMLP, VisionRMSNorm, get_activation

VISION_EPS = 1e-6  # the towers' norms (fixed in transformers, not in the config)


def _patch_rows_cols(grid_thw: list[list[int]], merge: int) -> torch.Tensor:
    """[P, 2] (row, column) of every patch, in the processor's merge-block order."""
    out = []
    for t, h, w in grid_thw:
        rows = torch.arange(h).view(h, 1).expand(h, w)
        cols = torch.arange(w).view(1, w).expand(h, w)
        # [h, w] -> [h/m, m, w/m, m] -> merge blocks row-major, row-major inside each
        blocks = [x.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten() for x in (rows, cols)]
        out.append(torch.stack(blocks, dim=-1).repeat(t, 1))
    return torch.cat(out)


def _segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
    """Bidirectional attention within consecutive segments of ``seqlens`` tokens: q, k, v [P, heads, d]
    -> [P, heads, d]. Segments of one length run as one batch (windows mostly share a length)."""
    out = torch.empty_like(q)
    starts: dict[int, list[int]] = {}
    offset = 0
    for length in seqlens:
        if length:
            starts.setdefault(length, []).append(offset)
        offset += length
    for length, firsts in starts.items():
        index = (torch.tensor(firsts)[:, None] + torch.arange(length)).to(q.device)  # [n, L]
        qs, ks, vs = (x[index].transpose(1, 2) for x in (q, k, v))  # [n, heads, L, d]
        out[index] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
    return out


def window_order(grid_thw: list[list[int]], merge: int, window_size: int, patch_size: int) -> tuple[torch.Tensor,
                                                                                                    list[int]]:
    """Qwen2.5-VL's windows: (merged-token order [P / m^2], window by window, and each window's
    length in patches). Windows are ``window_size // patch_size // m`` merged tokens square, per frame."""
    side = window_size // patch_size // merge
    if side < 1:
        raise ValueError(f"vision window_size {window_size} is smaller than one merged token "
                         f"({patch_size} x {merge} pixels)")
    order, lengths, offset = [], [], 0
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).view(t, gh, gw)
        num_h, num_w = -(-gh // side), -(-gw // side)
        padded = F.pad(index, (0, num_w * side - gw, 0, num_h * side - gh), value=-1)
        # [t, num_h, side, num_w, side] -> [t, num_h, num_w, side, side]: one window after another
        windows = padded.view(t, num_h, side, num_w, side).permute(0, 1, 3, 2, 4).reshape(-1, side * side)
        for window in windows:
            window = window[window >= 0]
            order.append(window + offset)
            lengths.append(len(window) * merge * merge)
        offset += t * gh * gw
    return torch.cat(order), lengths


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, ctx: ModelContext) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"vision width {dim} is not divisible by num_heads {num_heads}")
        self.num_heads, self.head_size = num_heads, dim // num_heads
        self.qkv = vision_linear(dim, 3 * dim, ctx)
        self.proj = vision_linear(dim, dim, ctx)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        num_patches = hidden.shape[0]
        q, k, v = self.qkv(hidden).view(num_patches, 3, self.num_heads, self.head_size).unbind(1)  # [P, heads, d]

        def rotate(x: torch.Tensor) -> torch.Tensor:  # neox halves, in float32
            x1, x2 = x.float().chunk(2, dim=-1)
            return (x.float() * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)

        out = _segment_attention(rotate(q), rotate(k), v, seqlens)
        return self.proj(out.reshape(num_patches, -1))


class Qwen2_5VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str, ctx: ModelContext) -> None:
        super().__init__()
        self.gate_proj = vision_linear(dim, hidden, ctx)
        self.up_proj = vision_linear(dim, hidden, ctx)
        self.act = get_activation(act, "vision hidden_act")
        self.down_proj = vision_linear(hidden, dim, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, norm1: nn.Module, norm2: nn.Module, attn: VisionAttention, mlp: nn.Module) -> None:
        super().__init__()
        self.norm1, self.norm2, self.attn, self.mlp = norm1, norm2, attn, mlp

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        hidden = hidden + self.attn(self.norm1(hidden), cos, sin, seqlens)
        return hidden + self.mlp(self.norm2(hidden))


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, dim: int, merge: int, ln_q: nn.Module, ctx: ModelContext) -> None:
        super().__init__()
        self.merged_dim = dim * merge * merge
        self.ln_q = ln_q
        self.mlp = nn.Sequential(vision_linear(self.merged_dim, self.merged_dim, ctx), nn.GELU(),
                                 vision_linear(self.merged_dim, out_dim, ctx))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(hidden).view(-1, self.merged_dim))  # [P, D] -> [P / m^2, out]


class Qwen2VisionTransformer(nn.Module):
    """Qwen2-VL's tower (``vision_config``: transformers' ``Qwen2VLVisionConfig``)."""

    def __init__(self, vision_config: Any, ctx: ModelContext) -> None:
        super().__init__()
        cfg = vision_config
        self.merge = cfg.spatial_merge_size
        self.patch_size, self.temporal_patch_size = cfg.patch_size, cfg.temporal_patch_size
        self.in_channels = getattr(cfg, "in_channels", 3)
        dim, out_dim = self.width(cfg), self.out_width(cfg)
        self.patch_embed = nn.Module()
        kernel = (self.temporal_patch_size, self.patch_size, self.patch_size)
        self.patch_embed.proj = nn.Conv3d(self.in_channels, dim, kernel, stride=kernel, bias=False, dtype=ctx.dtype)
        self.blocks = nn.ModuleList(self.make_block(cfg, ctx) for _ in range(cfg.depth))
        self.merger = PatchMerger(out_dim, dim, self.merge, self.make_norm(dim, ctx), ctx)
        self.rope_theta = float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") or 10000.0)
        self.rope_dim = dim // cfg.num_heads // 2  # half the head's frequencies from the row, half from the column

    # -- what Qwen2.5-VL changes ------------------------------------------------------------
    @staticmethod
    def width(cfg: Any) -> int:
        return cfg.embed_dim

    @staticmethod
    def out_width(cfg: Any) -> int:
        return cfg.hidden_size

    @staticmethod
    def make_norm(dim: int, ctx: ModelContext) -> nn.Module:
        return nn.LayerNorm(dim, eps=VISION_EPS, dtype=ctx.dtype)

    def make_block(self, cfg: Any, ctx: ModelContext) -> VisionBlock:
        dim = cfg.embed_dim
        return VisionBlock(self.make_norm(dim, ctx), self.make_norm(dim, ctx), VisionAttention(dim, cfg.num_heads, ctx),
                           VisionMLP(dim, int(dim * cfg.mlp_ratio), cfg.hidden_act, ctx))

    def attention_plan(self, grid: list[list[int]]) -> tuple[torch.Tensor | None, list[list[int]]]:
        """(merged-token order to run the blocks in, None: as given; each block's segment lengths)."""
        frames = [h * w for t, h, w in grid for _ in range(t)]
        return None, [frames] * len(self.blocks)

    # -- forward -----------------------------------------------------------------------------
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [P, C * Tp * p * p], grid_thw [N, 3] -> the merged tokens [P / m^2, out_hidden]
        of every image, in order."""
        grid = [[int(x) for x in row] for row in grid_thw.tolist()]
        num_patches = sum(t * h * w for t, h, w in grid)
        if pixel_values.shape[0] != num_patches or any(h % self.merge or w % self.merge for _, h, w in grid):
            raise ValueError(f"pixel_values of {pixel_values.shape[0]} patches do not match image_grid_thw {grid} "
                             f"(t * h * w patches an image, h and w multiples of {self.merge}); use the model's "
                             "image processor")
        weight = self.patch_embed.proj.weight  # [D, C, Tp, p, p]
        hidden = F.linear(pixel_values.reshape(num_patches, -1).to(weight.dtype), weight.flatten(1))  # [P, D]
        cos, sin = self.rope_cos_sin(grid, hidden.device)
        order, seqlens = self.attention_plan(grid)
        if order is not None:  # patches (and their angles) window by window; merge blocks stay whole
            unit = self.merge * self.merge
            patch_order = (order[:, None] * unit + torch.arange(unit)).flatten().to(hidden.device)
            hidden, cos, sin = hidden[patch_order], cos[patch_order], sin[patch_order]
        for block, block_seqlens in zip(self.blocks, seqlens):
            hidden = block(hidden, cos, sin, block_seqlens)
        merged = self.merger(hidden)  # [P / m^2, out]
        if order is not None:
            merged = merged[torch.argsort(order).to(merged.device)]
        return merged

    def rope_cos_sin(self, grid: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [P, 1, d] (float32, whatever the model dtype; computed on the host, as transformers does)."""
        inv_freq = 1.0 / self.rope_theta ** (torch.arange(0, self.rope_dim, 2, dtype=torch.float) / self.rope_dim)
        freqs = (_patch_rows_cols(grid, self.merge)[..., None] * inv_freq).flatten(1)  # [P, d/2]: row's, column's
        angles = torch.cat([freqs, freqs], dim=-1)[:, None, :].to(device)  # [P, 1, d]: broadcast over heads
        return angles.cos(), angles.sin()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], prefix: str = "") -> set[str]:
        """Checkpoint tensors named as in transformers' tower (``blocks.0.attn.qkv.weight``) -> the set of
        loaded parameter names. ``prefix``: where the tower sits in the checkpoint, for error messages."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {prefix + name!r} has no matching parameter in "
                                 f"{type(self).__name__}; is this checkpoint's vision tower a different version's?")
            if param.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {prefix + name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)}")
            param.data.copy_(tensor)
            loaded.add(name)
        return loaded


class Qwen2_5VisionTransformer(Qwen2VisionTransformer):
    """Qwen2.5-VL's tower (``vision_config``: transformers' ``Qwen2_5_VLVisionConfig``)."""

    def __init__(self, vision_config: Any, ctx: ModelContext) -> None:
        super().__init__(vision_config, ctx)
        self.window_size = vision_config.window_size
        self.fullatt_block_indexes = {int(i) for i in vision_config.fullatt_block_indexes}

    @staticmethod
    def width(cfg: Any) -> int:
        return cfg.hidden_size

    @staticmethod
    def out_width(cfg: Any) -> int:
        return cfg.out_hidden_size

    @staticmethod
    def make_norm(dim: int, ctx: ModelContext) -> nn.Module:
        return VisionRMSNorm(dim, VISION_EPS, ctx)

    def make_block(self, cfg: Any, ctx: ModelContext) -> VisionBlock:
        dim = cfg.hidden_size
        return VisionBlock(self.make_norm(dim, ctx), self.make_norm(dim, ctx), VisionAttention(dim, cfg.num_heads, ctx),
                           Qwen2_5VisionMLP(dim, cfg.intermediate_size, cfg.hidden_act, ctx))

    def attention_plan(self, grid: list[list[int]]) -> tuple[torch.Tensor | None, list[list[int]]]:
        order, windows = window_order(grid, self.merge, self.window_size, self.patch_size)
        frames = [h * w for t, h, w in grid for _ in range(t)]  # window order keeps each frame's patches together
        return order, [frames if i in self.fullatt_block_indexes else windows for i in range(len(self.blocks))]

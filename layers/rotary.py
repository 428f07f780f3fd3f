"""Rotary position embeddings: default, linear, dynamic NTK, YaRN, Llama-3 and LongRoPE scaling, and
multimodal rope (M-RoPE, Qwen2-VL) on top of any of them.

Each scaling type only changes the inverse frequencies (and, for YaRN and LongRoPE, a
magnitude factor on cos/sin). ``partial_rotary_factor`` rotates only the first
R = head_size * factor dims of each head. The formulas follow transformers' ``modeling_rope_utils`` operation
for operation, so the fp32 tables are bit-identical to HF's cos/sin::

    inv_freq [R/2]; freqs = positions * inv_freq       [P, R/2]
    cos_sin_cache = cat(cos(freqs) * m, sin(freqs) * m)  [P, R]   (m = attention factor)

The cache is kept in float32 whatever the model dtype: kernels read it with positions
and cast, and fp32 keeps long-context angles accurate.

M-RoPE (``mrope_section`` [s_t, s_h, s_w] in the rope parameters, s_t + s_h + s_w = R/2) gives each token
three positions (temporal, height, width: [3, T]) and takes frequency i's angle from the t, h or w position
by the section i falls in, repeated over the sections' list (transformers' ``apply_multimodal_rotary_pos_emb``)::

    frequencies  | 0 .. s_t-1 | s_t .. s_t+s_h-1 | .. R/2-1 |
    position of  |     t      |        h         |    w     |

Text tokens have t = h = w, so a [T] ``positions`` (a text-only batch) is plain rope.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from halserve.kernels import resolve_kernel
from halserve.layers.context import ModelContext

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
# older spellings -> the type they mean; errors quote the config's own spelling
ROPE_TYPE_ALIASES = {"su": "longrope"}  # "su": LongRoPE in the first Phi-3 configs
MROPE_TYPE = "mrope"  # older Qwen2-VL configs' rope type: default frequencies, with mrope_section


def rope_parameters_from_config(hf_config: Any) -> dict[str, Any]:
    """One flat dict with ``rope_type`` and ``rope_theta`` from an HF config.

    transformers v5 keeps everything in ``config.rope_parameters``; older checkpoints (and
    v4 configs) have ``rope_scaling`` (with ``type`` or ``rope_type``) plus ``rope_theta``.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    is_scaled = ROPE_TYPE_ALIASES.get(rope_type, rope_type) in ("llama3", "yarn", "longrope")
    if is_scaled and params.get("original_max_position_embeddings") is None:
        params["original_max_position_embeddings"] = getattr(
            hf_config, "original_max_position_embeddings", hf_config.max_position_embeddings
        )
    if params.get("partial_rotary_factor") is None and getattr(hf_config, "partial_rotary_factor", None) is not None:
        params["partial_rotary_factor"] = hf_config.partial_rotary_factor  # v4 configs keep it at the top level
    return params


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(dtype=torch.float) / dim))


def compute_inv_freq(params: dict[str, Any], rotary_dim: int, max_position_embeddings: int,
                     max_model_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2] fp32, attention factor) for one rope configuration.

    ``max_model_len`` (None = max_position_embeddings) picks LongRoPE's factor set."""
    rope_type = ROPE_TYPE_ALIASES.get(params["rope_type"], params["rope_type"])
    base = float(params["rope_theta"])
    dim = rotary_dim
    if rope_type == "default":
        return _base_inv_freq(base, dim), 1.0
    if rope_type == "linear":
        return _base_inv_freq(base, dim) / params["factor"], 1.0
    if rope_type == "dynamic":
        # HF rescales per call from max(position)+1; within max_position_embeddings (the
        # only range halserve serves, see get_model_info) that is the plain frequencies.
        return _base_inv_freq(base, dim), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(params, base, dim), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(params, base, dim, max_position_embeddings)
    if rope_type == "longrope":
        return _longrope_inv_freq(params, base, dim, max_position_embeddings, max_model_len)
    raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")


def _llama3_inv_freq(params: dict[str, Any], base: float, dim: int) -> torch.Tensor:
    inv_freq = _base_inv_freq(base, dim)
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def _yarn_inv_freq(params: dict[str, Any], base: float, dim: int, max_position_embeddings: int):
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp  # 1 for high-frequency dims: keep them as trained
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def _check_longrope_factors(params: dict[str, Any], dim: int) -> None:
    for key in ("short_factor", "long_factor"):
        factors = params.get(key)
        if factors is None:
            raise ValueError(
                f"rope type {params['rope_type']!r} (LongRoPE) needs rope_parameters[{key!r}], a list of "
                f"rotary_dim / 2 = {dim // 2} numbers; add it to the checkpoint's config.json, or pick another rope "
                f"type (supported: {', '.join(ROPE_TYPES)})"
            )
        if not isinstance(factors, (list, tuple)) or not all(isinstance(x, (int, float)) for x in factors):
            raise ValueError(f"rope_parameters[{key!r}] must be a list of numbers, got {factors!r}")
        if len(factors) != dim // 2:
            raise ValueError(
                f"rope_parameters[{key!r}] has {len(factors)} entries, but LongRoPE needs one per rotary frequency: "
                f"rotary_dim / 2 = {dim // 2} (rotary_dim {dim} = head_size x partial_rotary_factor "
                f"{params.get('partial_rotary_factor', 1.0)}); fix the list in the checkpoint's config.json"
            )


def _longrope_inv_freq(params: dict[str, Any], base: float, dim: int, max_position_embeddings: int,
                       max_model_len: int | None):
    """LongRoPE (Phi-3, Phi-3.5, Phi-4-mini): inv_freq = 1 / (factors * base^(2i/R)), with a
    per-frequency ``short_factor`` or ``long_factor`` list.

    HF chooses the list per forward call: the long one once max(position) + 1 exceeds
    original_max_position_embeddings, and then for every position of that call (its generate
    even drops the KV cache and recomputes the whole sequence when it first crosses the
    threshold). A paged server cannot re-rotate keys already in the cache, and a prefix-cached
    block must mean the same to every request that reuses it, so, like vLLM, halserve chooses
    once per engine: the long factors when max_model_len exceeds original_max_position_embeddings,
    the short ones otherwise. That equals HF exactly when max_model_len <= the original maximum
    (HF never switches then) and, with a larger max_model_len, for prompts longer than the
    original maximum; shorter requests then get the long factors where HF uses the short ones.
    """
    _check_longrope_factors(params, dim)
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:  # Phi-3 states the extension as max_position_embeddings over the original
        factor = max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))
    use_long = (max_model_len or max_position_embeddings) > original_max
    ext_factors = torch.tensor(params["long_factor" if use_long else "short_factor"], dtype=torch.float32, device="cpu")
    inv_freq_shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (ext_factors * base**inv_freq_shape), attention_factor


def build_cos_sin_cache(inv_freq: torch.Tensor, max_position: int, attention_factor: float = 1.0) -> torch.Tensor:
    """[max_position, R] fp32 = cat(cos, sin) of positions * inv_freq, times the attention factor.

    Computed on the host (like HF) so every platform gets the same table."""
    positions = torch.arange(max_position, dtype=torch.int64, device="cpu").float()
    freqs = positions[:, None] * inv_freq[None, :].float()  # [P, R/2]
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies rope to q [T, Hq * D] and k [T, Hk * D] at ``positions`` [T] (neox layout:
    rotate halves, as HF Llama/Mistral/Qwen do)."""

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, params: dict[str, Any],
                 max_position_embeddings: int, ctx: ModelContext, is_neox: bool = True,
                 max_model_len: int | None = None) -> None:
        super().__init__()
        if rotary_dim > head_size or rotary_dim % 2:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_size {head_size}")
        self.head_size, self.rotary_dim, self.is_neox = head_size, rotary_dim, is_neox
        inv_freq, attention_factor = compute_inv_freq(params, rotary_dim, max_position_embeddings, max_model_len)
        cache = build_cos_sin_cache(inv_freq, max_position, attention_factor)
        # non-persistent: recomputed, never loaded; fp32 even when the model dtype is not
        self.register_buffer("cos_sin_cache", cache.to(torch.get_default_device()), persistent=False)
        self.kernel = resolve_kernel("rotary_embedding", ctx.platform_name, dtype=ctx.dtype_name,
                                     head_size=head_size, rotary_dim=rotary_dim, is_neox=is_neox)

    def _apply(self, fn, recurse=True):
        # model.to(bfloat16) would cast the table: follow the device change only
        fp32_cache = self.cos_sin_cache
        out = super()._apply(fn, recurse)
        self.cos_sin_cache = fp32_cache.to(self.cos_sin_cache.device)
        return out

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return self.kernel(positions, q, k, self.cos_sin_cache, self.head_size, self.is_neox)

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, max_position={self.cos_sin_cache.shape[0]}"


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE (module docstring): ``positions`` [3, T] (t, h, w) or [T] (all three equal) -> rotated q, k."""

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, params: dict[str, Any],
                 max_position_embeddings: int, ctx: ModelContext, mrope_section: list[int], is_neox: bool = True,
                 max_model_len: int | None = None) -> None:
        super().__init__(head_size, rotary_dim, max_position, params, max_position_embeddings, ctx, is_neox,
                         max_model_len)
        if len(mrope_section) != 3 or sum(mrope_section) != rotary_dim // 2:
            raise ValueError(f"mrope_section {list(mrope_section)} must be 3 numbers (temporal, height, width) summing "
                             f"to rotary_dim / 2 = {rotary_dim // 2}")
        self.mrope_section = [int(s) for s in mrope_section]
        axis = torch.repeat_interleave(torch.arange(3), torch.tensor(self.mrope_section))  # [R/2]: 0, .., 1, .., 2
        # [R]: which position row each column of cat(cos, sin) is read from
        self.register_buffer("axis_of_column", torch.cat([axis, axis]).to(torch.get_default_device()),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        if positions.dim() != 2 or positions.shape[0] != 3:
            raise ValueError(f"M-RoPE positions must be [T] or [3, T], got shape {tuple(positions.shape)}")
        num_tokens = positions.shape[1]
        table = self.cos_sin_cache[positions]  # [3, T, R]
        column_axis = self.axis_of_column.view(1, 1, -1).expand(1, num_tokens, -1)
        table = table.gather(0, column_axis)[0]  # [T, R]: each column from its section's row
        # each token gets its own row: the kernel reads row i for token i
        rows = torch.arange(num_tokens, device=positions.device)
        return self.kernel(rows, q, k, table, self.head_size, self.is_neox)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mrope_section={self.mrope_section}"


def get_rope(hf_config: Any, head_size: int, ctx: ModelContext) -> RotaryEmbedding:
    """The rotary embedding an HF Llama-family config asks for (``MRotaryEmbedding`` when its rope
    parameters have an ``mrope_section``, or rope type "mrope")."""
    params = rope_parameters_from_config(hf_config)
    mrope_section = params.get("mrope_section")
    if params["rope_type"] == MROPE_TYPE:
        if mrope_section is None:
            raise ValueError("rope type 'mrope' needs rope_parameters['mrope_section'] (temporal, height, width "
                             "frequency counts); add it to the checkpoint's config.json")
        params["rope_type"] = "default"
    if ROPE_TYPE_ALIASES.get(params["rope_type"], params["rope_type"]) not in ROPE_TYPES:
        raise ValueError(
            f"rope type {params['rope_type']!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    rotary_dim = int(head_size * params.get("partial_rotary_factor", 1.0))
    max_pos_emb = hf_config.max_position_embeddings
    max_position = max(ctx.max_position or 0, max_pos_emb)
    if mrope_section is not None:
        if params.get("mrope_interleaved"):
            raise ValueError("interleaved M-RoPE (mrope_interleaved) is not supported; only sectioned M-RoPE "
                             "(Qwen2-VL, Qwen2.5-VL)")
        return ctx.layer(MRotaryEmbedding)(head_size, rotary_dim, max_position, params, max_pos_emb, ctx, mrope_section,
                                max_model_len=ctx.max_position)
    return ctx.layer(RotaryEmbedding)(head_size, rotary_dim, max_position, params, max_pos_emb, ctx,
                           max_model_len=ctx.max_position)

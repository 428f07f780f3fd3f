"""Tiny quantized checkpoints for the quantization tests, written in each tool's own format.

``make_ct_checkpoint(base, out, scheme, group_size=32, actorder=None, ignore=("lm_head",))``: a
compressed-tensors checkpoint written by compressed-tensors itself (the library llm-compressor
saves with): its preset ``scheme`` (``"W4A16"``, ``"W4A16_ASYM"``, ``"W8A8"``, ``"FP8"``,
``"FP8_DYNAMIC"``, ``"FP8_BLOCK"``) applied to every ``Linear`` of the float checkpoint ``base``,
min-max scales from compressed-tensors' ``calculate_qparams``, compressed with ``ModelCompressor``.
(compressed-tensors dropped act-order ``weight_g_idx`` in 2026; GPTQ's act-order is tested instead.)

``make_gptq_checkpoint`` / ``make_awq_checkpoint(base, out, group_size=32, desc_act=False)``: each
quantized linear replaced by GPTQ v1 / AutoAWQ GEMM tensors (``halserve.kernels.packing``, which
follows those tools' pack code) with the tool's ``quantization_config``.

``make_fp8_checkpoint(base, out, block_size=None, static=False)``: a ``quant_method: "fp8"``
checkpoint: per-tensor (``weight_scale``, ``input_scale`` when static) or block-wise
(``weight_scale_inv`` per ``block_size`` block).

Each returns ``(path, dequantized)``: ``dequantized`` maps a linear's checkpoint name (e.g.
``model.layers.0.self_attn.q_proj``) to the float weight the quantized tensors stand for, so a test
can build the float model the checkpoint represents (``dequantized_hf_model``).

``load_halserve(path, **config)``: halserve's model of a checkpoint, for logit comparisons.
"""
from __future__ import annotations

import json
import math
import os
import shutil

import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_LINEARS = ("w1", "w2", "w3")  # Mixtral's expert projections (Qwen MoE's use LINEARS' names)


def _copy_base(base: str, out: str) -> None:
    shutil.copytree(base, out, dirs_exist_ok=True)
    for name in os.listdir(out):
        if name.endswith((".safetensors", ".safetensors.index.json")):
            os.remove(os.path.join(out, name))


def _hf(path: str):
    import transformers

    with open(os.path.join(path, "config.json")) as f:
        architecture = json.load(f)["architectures"][0]  # e.g. a vision-language model's own class
    return getattr(transformers, architecture).from_pretrained(path, dtype=torch.float32).eval()


def _linear_names(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in LINEARS]


def _shared_perm(name: str, k: int, group_size: int, seed: int) -> torch.Tensor:
    """An act-order g_idx shared by the parts of a fused layer (same input, same Hessian)."""
    layer = name.rsplit(".", 2)[0] + ("/attn_in" if name.endswith(("q_proj", "k_proj", "v_proj")) else
                                      "/mlp_in" if name.endswith(("gate_proj", "up_proj")) else name)
    gen = torch.Generator().manual_seed(seed + sum(map(ord, layer)))
    return (torch.arange(k) // group_size)[torch.randperm(k, generator=gen)].to(torch.int32)


# -- compressed-tensors -------------------------------------------------------------------------


def _minmax(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    strategy = str(args.strategy.value if hasattr(args.strategy, "value") else args.strategy)
    n, k = w.shape
    if strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if strategy == "channel":
        return w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    if strategy == "group":
        g = w.reshape(n, k // args.group_size, args.group_size)
        return g.amin(dim=2), g.amax(dim=2)
    if strategy == "block":
        bn, bk = args.block_structure
        blocks = w.reshape(n // bn, bn, k // bk, bk)
        return blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    raise ValueError(strategy)


def make_ct_checkpoint(base: str, out: str, scheme: str, *, group_size: int = 32, ignore=("lm_head",)):
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    model = _hf(base)
    qscheme = preset_name_to_scheme(scheme, ["Linear"])
    if qscheme.weights.group_size and qscheme.weights.strategy == "group":
        qscheme.weights.group_size = group_size
    if qscheme.weights.strategy == "block":  # blocks (and activation groups) of group_size: tiny layers
        qscheme.weights.block_structure = [group_size, group_size]
        qscheme.input_activations.group_size = group_size
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": qscheme}, ignore=list(ignore)))
    dequantized = {}
    with torch.no_grad():
        for name in _linear_names(model):
            module = model.get_submodule(name)
            if not hasattr(module, "weight_scale"):
                continue  # ignored: stays in floats
            args = qscheme.weights
            scale, zero = calculate_qparams(*_minmax(module.weight.data, args), args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
            if hasattr(module, "input_scale"):  # static activations: a scale that fits these prompts
                module.input_scale.data.fill_(0.05)
            dequantized[name] = fake_quantize(module.weight.data, module.weight_scale.data,
                                              getattr(module, "weight_zero_point", None), args)
        compressor = ModelCompressor.from_pretrained_model(model)
        compressor.compress_model(model)
    _copy_base(base, out)
    model.save_pretrained(out)
    compressor.update_config(out)
    # compressed-tensors rewrites ``ignore`` as the module names it skipped, relative to a submodule
    # for some models (LLaVA's ``vision_tower...`` for ``model.vision_tower...``); keep the patterns given,
    # as llm-compressor recipes write them
    config_path = os.path.join(out, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"]["ignore"] = list(ignore)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    return out, dequantized


# -- GPTQ / AWQ ---------------------------------------------------------------------------------


def _is_linear(name: str) -> bool:
    """A linear layer's checkpoint name (MoE experts included: ``...experts.3.gate_proj``, ``...experts.3.w1``)."""
    last = name.rsplit(".", 1)[-1]
    return last in LINEARS or (".experts." in name and last in EXPERT_LINEARS)


def _write_packed(base: str, out: str, quant_config: dict, pack) -> tuple[str, dict]:
    """Replace each linear's weight [N, K] by ``pack(name, w.T [K, N])`` -> (tensors, dequantized [N, K]).
    Works on ``base``'s own tensors, so MoE experts are quantized one projection at a time as the
    quantization tools write them."""
    import glob

    from safetensors.torch import load_file, save_file

    state = {}
    for file in sorted(glob.glob(os.path.join(base, "*.safetensors"))):
        state.update(load_file(file))
    dequantized = {}
    for name in [n.removesuffix(".weight") for n in list(state) if n.endswith(".weight")]:
        if not _is_linear(name):
            continue
        w = state.pop(f"{name}.weight").float()
        tensors, deq = pack(name, w.T.contiguous())
        dequantized[name] = deq.T.contiguous()
        state.update({f"{name}.{k}": v.contiguous() for k, v in tensors.items()})
    _copy_base(base, out)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quant_config
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out, dequantized


def _quantize_symmetric(w: torch.Tensor, group_size: int):
    """Symmetric 4-bit: zero 8 in every group, ``w ~= (q - 8) * s`` with ``s = amax / 7``."""
    k, n = w.shape
    g = k if group_size == -1 else group_size
    wg = w.float().reshape(k // g, g, n)
    scales = (wg.abs().amax(dim=1) / 7).clamp(min=1e-6)
    q = (torch.round(wg / scales[:, None]) + 8).clamp(0, 15).to(torch.int32).reshape(k, n)
    return q, torch.full_like(scales, 8, dtype=torch.int32), scales


def make_gptq_checkpoint(base: str, out: str, *, group_size: int = 32, desc_act: bool = False, sym: bool = False,
                         seed: int = 0):
    from halserve.kernels.packing import dequantize_gptq, pack_gptq, quantize_4bit

    quantize = _quantize_symmetric if sym else quantize_4bit

    def pack(name, w):  # w [K, N]
        k = w.shape[0]
        g = k if group_size == -1 else group_size
        g_idx = _shared_perm(name, k, g, seed) if desc_act else (torch.arange(k) // g).to(torch.int32)
        # quantize with each row's group as the checkpoint will say (rows of a group gathered together)
        order = torch.argsort(g_idx, stable=True)
        q_sorted, zeros, scales = quantize(w[order], group_size)
        q = torch.empty_like(q_sorted)
        q[order] = q_sorted
        qweight, qzeros, scales16 = pack_gptq(q, zeros, scales)
        deq = dequantize_gptq(qweight, qzeros, scales16, g_idx, group_size)
        return {"qweight": qweight, "qzeros": qzeros, "scales": scales16, "g_idx": g_idx}, deq

    cfg = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
           "checkpoint_format": "gptq", "lm_head": False, "damp_percent": 0.01, "true_sequential": True}
    return _write_packed(base, out, cfg, pack)


def make_awq_checkpoint(base: str, out: str, *, group_size: int = 32, modules_to_not_convert=None):
    from halserve.kernels.packing import dequantize_awq, pack_awq, quantize_4bit

    skip = list(modules_to_not_convert or [])

    def pack(name, w):
        if any(m in name for m in skip):
            return {"weight": w.T.contiguous()}, w
        q, zeros, scales = quantize_4bit(w, group_size)
        qweight, qzeros, scales16 = pack_awq(q, zeros, scales)
        return {"qweight": qweight, "qzeros": qzeros, "scales": scales16}, dequantize_awq(qweight, qzeros, scales16,
                                                                                           group_size)

    cfg = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
           "modules_to_not_convert": modules_to_not_convert}
    return _write_packed(base, out, cfg, pack)


# -- fp8 ------------------------------------------------------------------------------------------


def make_fp8_checkpoint(base: str, out: str, *, block_size: tuple[int, int] | None = None, static: bool = False):
    fp8 = torch.float8_e4m3fn
    fmax = torch.finfo(fp8).max

    def pack(name, w):  # w [K, N] -> weight [N, K]
        w = w.T.contiguous()
        if block_size is None:
            scale = (w.abs().amax() / fmax).reshape(())
            q = (w / scale).to(fp8)
            tensors = {"weight": q, "weight_scale": scale}
            if static:
                tensors["input_scale"] = torch.tensor(8 / 448)
            return tensors, (q.float() * scale).T
        bn, bk = block_size
        n, k = w.shape
        blocks = w.reshape(math.ceil(n / bn), bn, math.ceil(k / bk), bk)
        scale = (blocks.abs().amax(dim=(1, 3)) / fmax).clamp(min=1e-12)  # [N/Bn, K/Bk]
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        q = (w / full).to(fp8)
        return {"weight": q, "weight_scale_inv": scale}, (q.float() * full).T

    cfg = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"}
    if block_size is not None:
        cfg["weight_block_size"] = list(block_size)
    return _write_packed(base, out, cfg, pack)


def load_halserve(path: str, **config):
    """The model as the engine builds it (float32, CPU platform, torch reference attention);
    ``config``: more EngineConfig fields (e.g. ``quantization="fp8"``)."""
    from halserve.attention_backends.torch_ref import TorchAttentionBackend
    from halserve.config import EngineConfig
    from halserve.models.loader import get_model_info, load_model
    from halserve.platforms.cpu import CpuPlatform

    engine_config = EngineConfig(model=path, dtype="float32", **config)
    platform = CpuPlatform()
    return load_model(engine_config, get_model_info(engine_config, platform), platform, TorchAttentionBackend,
                      progress=False)


def dequantized_hf_model(base: str, dequantized: dict):
    """The float transformers model of ``base`` with each quantized linear's weight replaced by what
    the quantized checkpoint stands for."""
    model = _hf(base)
    with torch.no_grad():
        for name, w in dequantized.items():
            if ".experts." not in name:
                model.get_submodule(name).weight.copy_(w)
                continue
            # transformers holds every expert in 3-D tensors: gate_up_proj [E, 2I, H] (gate rows first),
            # down_proj [E, H, I]
            moe, expert, proj = name.replace(".block_sparse_moe.", ".mlp.").rsplit(".", 2)
            experts, e = model.get_submodule(moe), int(expert)
            if proj in ("down_proj", "w2"):
                experts.down_proj[e].copy_(w)
            else:
                rows = experts.gate_up_proj.shape[1] // 2
                start = 0 if proj in ("gate_proj", "w1") else rows
                experts.gate_up_proj[e, start : start + rows].copy_(w)
    return model

"""Reading a LoRA adapter in PEFT's format (what ``PeftModel.save_pretrained`` writes).

    adapter_config.json          r, lora_alpha, target_modules, use_rslora, bias, ...
    adapter_model.safetensors    base_model.model.<module>.lora_A.weight   [r, in]
                                 base_model.model.<module>.lora_B.weight   [out, r]
                                 (adapter_model.bin, a torch pickle, is read too)

A LoRA linear computes ``y = x W^T + scaling * (x A^T) B^T`` with ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with rslora). Everything this module cannot serve faithfully is
refused with an error naming the adapter and the fix, never silently ignored.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from halserve.lora.request import LoRARequest

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
_PREFIX = "base_model.model."


@dataclass(frozen=True, slots=True)
class PeftLoRAConfig:
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: list[str] | str | None  # names (suffixes), a regex, "all-linear", or None

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


def adapter_error(lora: LoRARequest, message: str) -> ValueError:
    return ValueError(f"LoRA adapter {lora.lora_name!r} ({lora.lora_path}): {message}")


def resolve_adapter_dir(lora: LoRARequest) -> str:
    """A local directory for ``lora.lora_path``: itself, or a Hugging Face hub snapshot."""
    path = os.path.expanduser(lora.lora_path)
    if os.path.isdir(path):
        return path
    if os.path.exists(path) or path.startswith((".", "/")) or path.count("/") != 1:
        raise adapter_error(lora, "not a directory; lora_path must be a PEFT adapter directory holding "
                                  f"{CONFIG_NAME} and adapter_model.safetensors (or a hub id like org/name)")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, allow_patterns=[CONFIG_NAME, *WEIGHTS_NAMES])
    except Exception as exc:  # offline, unknown id, no access ...
        raise adapter_error(lora, f"neither a local directory nor downloadable from the Hugging Face hub "
                                  f"({type(exc).__name__}: {exc})") from None


def read_peft_config(lora: LoRARequest, adapter_dir: str, max_lora_rank: int) -> PeftLoRAConfig:
    """The adapter's config, validated: ValueError for what halserve does not serve."""
    path = os.path.join(adapter_dir, CONFIG_NAME)
    if not os.path.isfile(path):
        raise adapter_error(lora, f"no {CONFIG_NAME} in {adapter_dir}; is this a PEFT LoRA adapter directory?")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise adapter_error(lora, f"{CONFIG_NAME} is not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise adapter_error(lora, f"{CONFIG_NAME} must hold a JSON object")
    peft_type = str(cfg.get("peft_type") or "LORA").upper()
    if peft_type != "LORA":
        raise adapter_error(lora, f"peft_type {peft_type!r} is not supported; only LORA adapters are served")
    refused = {
        "use_dora": "DoRA (use_dora=true) is not supported; merge the adapter into the model or train plain LoRA",
        "modules_to_save": "modules_to_save ({value}) is not supported: those modules are fully fine-tuned copies; "
                           "merge the adapter into the model instead",
        "rank_pattern": "rank_pattern ({value}) is not supported; train with one r for every module",
        "alpha_pattern": "alpha_pattern ({value}) is not supported; train with one lora_alpha for every module",
        "target_parameters": "target_parameters ({value}) is not supported: LoRA on raw parameters (such as fused "
                             "MoE expert weights) is not served; train with target_modules only",
    }
    for key, why in refused.items():
        if cfg.get(key):
            raise adapter_error(lora, why.format(value=cfg[key]))
    if (bias := cfg.get("bias", "none")) not in ("none", None):
        raise adapter_error(lora, f"bias={bias!r} is not supported (the adapter trains bias terms); use bias='none'")
    # (fan_in_fan_out only describes GPT-2-style Conv1D base weights; lora_A/lora_B are stored as
    # nn.Linear weights either way, and PEFT itself turns it off for nn.Linear targets.)
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise adapter_error(lora, f"{CONFIG_NAME} needs a positive integer r, got {r!r}")
    if r > max_lora_rank:
        raise adapter_error(lora, f"rank r={r} exceeds max_lora_rank={max_lora_rank}; restart the engine with "
                                  f"max_lora_rank >= {r} (--max-lora-rank {r})")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise adapter_error(lora, f"lora_alpha must be a finite number, got {alpha!r}")
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise adapter_error(lora, f"use_rslora must be true or false, got {rslora!r}")
    return PeftLoRAConfig(r=r, lora_alpha=float(alpha), use_rslora=rslora, target_modules=cfg.get("target_modules"))


def read_lora_weights(lora: LoRARequest, adapter_dir: str) -> dict[str, dict[str, torch.Tensor]]:
    """``{module name (as in the base model, e.g. model.layers.0.self_attn.q_proj): {"A": [r, in],
    "B": [out, r]}}`` from the adapter's weights file."""
    for name in WEIGHTS_NAMES:
        path = os.path.join(adapter_dir, name)
        if os.path.isfile(path):
            break
    else:
        raise adapter_error(lora, f"no adapter weights in {adapter_dir} (expected {' or '.join(WEIGHTS_NAMES)})")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            tensors = load_file(path)
        else:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file
        raise adapter_error(lora, f"cannot read {os.path.basename(path)}: {type(exc).__name__}: {exc}") from None
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(_PREFIX)
        parts = name.split(".")
        if len(parts) >= 3 and parts[-1] == "weight" and parts[-2] in ("lora_A", "lora_B"):
            module, which = ".".join(parts[:-2]), parts[-2][-1]
        elif len(parts) >= 4 and parts[-1] == "weight" and parts[-3] in ("lora_A", "lora_B"):
            module, which = ".".join(parts[:-3]), parts[-3][-1]  # (saved with its adapter name)
        elif "lora_embedding" in key:
            raise adapter_error(lora, f"tensor {key!r}: LoRA on embeddings is not supported")
        elif "lora_magnitude_vector" in key:
            raise adapter_error(lora, f"tensor {key!r}: DoRA is not supported")
        else:
            raise adapter_error(lora, f"tensor {key!r} is not a lora_A/lora_B weight (modules_to_save, bias or "
                                      "another method's weights are not supported)")
        if tensor.dim() != 2:
            raise adapter_error(lora, f"tensor {key!r} has shape {tuple(tensor.shape)}; expected a matrix")
        modules.setdefault(module, {})[which] = tensor
    for module, pair in modules.items():
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise adapter_error(lora, f"module {module!r} has no {missing} weight; the adapter file is incomplete")
    if not modules:
        raise adapter_error(lora, f"{os.path.basename(path)} holds no LoRA weights")
    return modules


__all__ = ["PeftLoRAConfig", "adapter_error", "read_lora_weights", "read_peft_config", "resolve_adapter_dir"]

"""Tiny random LoRA adapters in PEFT's format, and the checkpoints they merge into.

    from lora_factory import make_adapter, merge_adapter
    adapter = make_adapter(tmp_path / "a1", base_path, r=8, lora_alpha=16, seed=1)
    merged = merge_adapter(base_path, adapter, tmp_path / "merged")   # W + scaling * B @ A

``make_adapter(tmp_dir, base_path, *, r=8, lora_alpha=16, target_modules=ALL_MODULES,
use_rslora=False, seed=0, config_overrides=None, shapes_from=None) -> str`` writes
``adapter_config.json`` (as PEFT's ``save_pretrained`` does) and ``adapter_model.safetensors``
with ``base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_A.weight`` [r, in] and
``lora_B.weight`` [out, r] for every layer of the base checkpoint. A and B are both random
(PEFT initialises B to zeros), scaled so the adapter changes greedy outputs clearly.
``shapes_from``: take the layer sizes from another checkpoint (an adapter that does not fit).

``merge_adapter(base_path, adapter_dir, tmp_dir) -> str``: a copy of the base checkpoint
whose adapted weights are ``W + scaling * B @ A`` (float32), the independent reference.
"""
from __future__ import annotations

import json
import math
import os
import shutil

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL_MODULES = ATTENTION + MLP


def _read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def module_shapes(base_path: str) -> dict[str, tuple[int, int]]:
    """(in, out) of each adaptable module of a Llama-family checkpoint."""
    cfg = _read_config(base_path)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head, cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def module_key(layer: int, module: str) -> str:
    parent = "self_attn" if module in ATTENTION else "mlp"
    return f"base_model.model.model.layers.{layer}.{parent}.{module}"


def make_adapter(tmp_dir, base_path: str, *, r: int = 8, lora_alpha: float = 16,
                 target_modules=ALL_MODULES, use_rslora: bool = False, seed: int = 0,
                 config_overrides: dict | None = None, shapes_from: str | None = None) -> str:
    from safetensors.torch import save_file

    path = os.fspath(tmp_dir)
    os.makedirs(path, exist_ok=True)
    shapes = module_shapes(shapes_from or base_path)
    num_layers = _read_config(base_path)["num_hidden_layers"]
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for module in target_modules:
            num_in, num_out = shapes[module]
            # x A^T has entries ~1; scaling * (x A^T) B^T ~0.5: a clear change, still a sane model
            key = module_key(layer, module)
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, num_in, generator=gen) / num_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(num_out, r, generator=gen) * 0.25 / r**0.5
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path, "r": r,
        "lora_alpha": lora_alpha, "lora_dropout": 0.0, "target_modules": list(target_modules), "bias": "none",
        "fan_in_fan_out": False, "use_rslora": use_rslora, "use_dora": False, "modules_to_save": None,
        "init_lora_weights": True, "inference_mode": True, "rank_pattern": {}, "alpha_pattern": {},
        **(config_overrides or {}),
    }
    with open(os.path.join(path, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return path


def merge_adapter(base_path: str, adapter_dir: str, tmp_dir) -> str:
    from safetensors.torch import load_file, save_file

    out = os.fspath(tmp_dir)
    shutil.copytree(base_path, out, dirs_exist_ok=True)
    with open(os.path.join(adapter_dir, "adapter_config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    scaling = cfg["lora_alpha"] / (math.sqrt(cfg["r"]) if cfg.get("use_rslora") else cfg["r"])
    lora = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    weights = load_file(os.path.join(base_path, "model.safetensors"))
    for key, a in lora.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removesuffix(".lora_A.weight")
        b = lora[module + ".lora_B.weight"]
        name = module.removeprefix("base_model.model.") + ".weight"
        weights[name] = (weights[name].double() + scaling * (b.double() @ a.double())).float().contiguous()
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


# -- engine-test helpers ------------------------------------------------------------------
ENGINE_KWARGS = dict(platform="cpu", dtype="float32", block_size=16, max_num_batched_tokens=64,
                     num_kv_blocks=160, max_num_seqs=8)
PROMPT_LENGTHS = [3, 21, 40, 90]  # under a block, several blocks, longer than the step budget (chunked)
NEW_TOKENS = 10


def greedy(logprobs=None):
    from halserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=logprobs)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def prompt_dicts(token_lists) -> list[dict]:
    return [{"prompt_token_ids": p} for p in token_lists]


def sampled_logprobs(output) -> list[float]:
    out = output.outputs[0]
    return [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]

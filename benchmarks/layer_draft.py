"""A draft model for the speculative-decoding benchmark: a checkpoint's first N decoder layers,
with its embeddings, final norm and LM head (a "layer-skip" draft of the same vocabulary).

    python benchmarks/layer_draft.py bench_out/models/W1 bench_out/models/W1-draft2 2
    python benchmarks/layer_draft.py bench_out/models/W1 bench_out/models/W1-damped 2 --damp 0.1

``--damp F`` writes instead a copy of the model whose layers past the first N write F times
their output: a synthetic target its N-layer draft agrees with more often (same cost per token).

How well such a draft agrees with its model depends on the model: for the random-weight W1
(initialised at std 0.02, so the embeddings dominate the residual stream) it agrees often; a
trained model's first layers agree less. The figures in BENCHMARKS.md say which was used.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys


def make_layer_draft(src: str, dst: str, num_layers: int) -> str:
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise SystemExit(f"num_layers must be in 1..{config['num_hidden_layers']}, got {num_layers}")
    config["num_hidden_layers"] = num_layers
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    weights = load_file(os.path.join(src, "model.safetensors"))
    layer = re.compile(r"model\.layers\.(\d+)\.")
    kept = {k: v for k, v in weights.items() if (m := layer.match(k)) is None or int(m.group(1)) < num_layers}
    save_file(kept, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "generation_config", "special_tokens")):
            shutil.copy(os.path.join(src, name), dst)
    return dst


def damp_upper_layers(src: str, dst: str, num_layers: int, factor: float) -> str:
    """A copy of ``src`` whose layers from ``num_layers`` on write ``factor`` times their output
    (o_proj and down_proj scaled): a synthetic target that its first ``num_layers`` layers
    (``make_layer_draft``) agree with more often, at the same cost per token."""
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    weights = load_file(os.path.join(src, "model.safetensors"))
    layer = re.compile(r"model\.layers\.(\d+)\.(self_attn\.o_proj|mlp\.down_proj)\.weight")
    for name, tensor in weights.items():
        if (m := layer.match(name)) is not None and int(m.group(1)) >= num_layers:
            weights[name] = tensor * factor
    save_file(weights, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    for name in os.listdir(src):
        if name != "model.safetensors":
            shutil.copy(os.path.join(src, name), dst)
    return dst


if __name__ == "__main__":
    args = sys.argv[1:]
    damp = None
    if "--damp" in args:
        i = args.index("--damp")
        damp = float(args[i + 1])
        del args[i : i + 2]
    if len(args) != 3:
        raise SystemExit("usage: python benchmarks/layer_draft.py SRC DST NUM_LAYERS [--damp F]")
    src, dst, num_layers = args[0], args[1], int(args[2])
    print(make_layer_draft(src, dst, num_layers) if damp is None else damp_upper_layers(src, dst, num_layers, damp))

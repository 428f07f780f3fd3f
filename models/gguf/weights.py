"""A GGUF checkpoint's tensors under the Hugging Face names halserve's models load, dequantized.

GGUF names tensors its own way (``blk.0.attn_q.weight``) and llama.cpp's converter changes some
on the way in (llama-arch q/k rows permuted for its rotary layout, Gemma's norms stored as
``1 + w``). transformers' GGUF loader knows both: its name map (``get_gguf_hf_weights_map``, over a
model built on the meta device) and its per-architecture tensor processors undo them, so halserve
reuses them rather than keeping a second copy.

Each tensor is dequantized (``gguf.quants.dequantize``) to float32 and cast to the model dtype as
it streams, except those named in ``keep_quantized`` (the linear layers of the ``gguf`` quantization
method, quant_methods/gguf.py): those come as the file's raw blocks, ``uint8 [rows, row bytes]``, with
transformers' row permutations applied to the block rows (a row of blocks is a row of values).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Collection, Iterator
from typing import Any

import torch

from halserve.models.gguf.reader import open_gguf

logger = logging.getLogger(__name__)

# llama.cpp's precomputed RoPE factors (Llama 3.1, Phi-3 long context): halserve computes them from the config
DERIVED_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# the end of every error for tensors that do not fit the config
CONFIG_MISMATCH = ("the config does not describe the file's tensors (with --hf-config-path: is it this model's "
                   "config.json? without: the file's metadata disagrees with its tensors, a damaged or wrongly "
                   "converted file: convert it again)")


@contextlib.contextmanager
def _one_tensor_name_map() -> Iterator[None]:
    """While it lasts, ``gguf.get_tensor_name_map(arch, n_blocks)`` builds each map once: transformers'
    ``get_gguf_hf_weights_map`` recurses into every submodule and asks for the same map at each (397 times
    for SmolLM2's 30 layers, ~13 ms each: 5.3 s of every GGUF start, twice), and only reads it."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def gguf_to_hf_names(architecture: str, hf_config: Any) -> tuple[dict[str, str], Any]:
    """``({gguf tensor name: HF parameter name}, transformers' tensor processor)`` for a checkpoint."""
    names, processor, _ = _hf_model_layout(architecture, hf_config)
    return names, processor


def _hf_model_layout(architecture: str, hf_config: Any) -> tuple[dict[str, str], Any, dict[str, tuple[int, ...]]]:
    """``gguf_to_hf_names``, and ``{HF parameter name: shape}`` of the model ``hf_config`` describes."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    with torch.device("meta"):  # names only: no memory, no initialization
        hf_model = AutoModelForCausalLM.from_config(hf_config)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=hf_config.to_dict())
    with _one_tensor_name_map():
        names = get_gguf_hf_weights_map(hf_model, processor, model_type=architecture,
                                        num_layers=hf_config.num_hidden_layers)
    shapes = {name: tuple(value.shape) for name, value in hf_model.state_dict().items()}
    return names, processor, shapes


def _check_tensors_fit_config(checkpoint: Any, tensors: list[Any], names: dict[str, str],
                              shapes: dict[str, tuple[int, ...]], hf_config: Any) -> None:
    """``ValueError`` before any weight is read when the file's tensors and the config disagree: a tensor
    whose number of values is not its parameter's (the tensor processors may permute or reshape, never
    resize), or fewer layers (``blk.N``) than the config's ``num_hidden_layers``."""
    for tensor in tensors:
        expected = shapes.get(names.get(tensor.name, ""))
        if expected is None:
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # (torch order: [out, in])
        if int(tensor.n_elements) != math.prod(expected):
            raise ValueError(f"GGUF tensor {tensor.name!r} of {checkpoint.describe()} has shape {list(shape)}, but "
                             f"the config ({hf_config.model_type}, hidden_size {hf_config.hidden_size}) needs "
                             f"{list(expected)} for {names[tensor.name]}: {CONFIG_MISMATCH}")
    blocks = {int(t.name.split(".")[1]) for t in tensors if t.name.startswith("blk.") and t.name.split(".")[1].isdigit()}
    layers = hf_config.num_hidden_layers
    if blocks and len(blocks) < layers:
        absent = sorted(set(range(layers)) - blocks)
        raise ValueError(f"{checkpoint.describe()} has tensors for {len(blocks)} layers (blk.N) but the config says "
                         f"{layers} (num_hidden_layers; blk.{absent[0]} is missing): {CONFIG_MISMATCH}")


def gguf_tensor_types(path: str, hf_config: Any) -> dict[str, str]:
    """``{HF weight name: GGUF type name}`` of every tensor of the checkpoint ``path`` that has an HF name."""
    checkpoint = open_gguf(path)
    names, _ = gguf_to_hf_names(checkpoint.architecture, hf_config)
    return {names[t.name]: t.tensor_type.name for reader in checkpoint.readers for t in reader.tensors
            if t.name in names}


def iterate_gguf_weights(path: str, hf_config: Any, dtype: torch.dtype, progress: bool | None = None,
                         keep_quantized: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(HF name, tensor in dtype)`` pairs of the GGUF checkpoint ``path``, tensor by tensor.
    llama.cpp's precomputed RoPE factors are skipped; any other tensor without an HF counterpart is a
    ``ValueError`` before anything is read (a config that does not describe the file). Tensors whose HF
    name is in ``keep_quantized`` come as their raw blocks (uint8), not dequantized."""
    import numpy as np
    from gguf import dequantize

    checkpoint = open_gguf(path)
    names, processor, shapes = _hf_model_layout(checkpoint.architecture, hf_config)
    keep_quantized = set(keep_quantized)
    logger.info("loading GGUF %s: %s", checkpoint.describe(),
                f"{len(keep_quantized)} linear weights kept in their GGUF blocks, the rest dequantized to "
                f"{str(dtype).replace('torch.', '')}" if keep_quantized else
                f"weights dequantized to {str(dtype).replace('torch.', '')} at load")
    tensors = [t for reader in checkpoint.readers for t in reader.tensors if t.name not in DERIVED_TENSORS]
    unknown = [t.name for t in tensors if t.name not in names]
    if unknown:
        raise ValueError(
            f"GGUF tensors {', '.join(unknown[:4])}{' ...' if len(unknown) > 4 else ''} ({len(unknown)} in all) of "
            f"{checkpoint.describe()} have no counterpart in the model its config describes "
            f"({hf_config.model_type}, {hf_config.num_hidden_layers} layers): {CONFIG_MISMATCH}")
    _check_tensors_fit_config(checkpoint, tensors, names, shapes, hf_config)
    bar = None
    if progress or (progress is None and len(tensors) and sum(int(t.n_bytes) for t in tensors) > 1 << 30):
        from tqdm.auto import tqdm

        bar = tqdm(total=len(tensors), desc="Dequantizing GGUF tensors", unit="tensor")
    parsed = {"config": hf_config.to_dict()}  # (what transformers' processors may consult)
    try:
        for tensor in tensors:
            raw = tensor.name in names and names[tensor.name] in keep_quantized
            # float32 [rows, cols] in torch order, or the raw blocks uint8 [rows, row bytes]
            values = tensor.data if raw else dequantize(tensor.data, tensor.tensor_type)
            result = processor.process(weights=values, name=tensor.name, tensor_key_mapping=names,
                                       parsed_parameters=parsed)
            if bar is not None:
                bar.update(1)
            hf_name = names[result.name]
            # the memory-mapped F32 tensors are read-only: copy those (dequantized ones are fresh arrays)
            values = np.require(result.weights, requirements=["C", "W"])
            yield hf_name, torch.from_numpy(values) if raw else torch.from_numpy(values).to(dtype)
    finally:
        if bar is not None:
            bar.close()

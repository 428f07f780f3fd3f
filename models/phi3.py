"""Phi-3 and Phi-4-mini (``Phi3ForCausalLM``): the Llama decoder, read from fused checkpoint tensors.

    differences from Llama              handled by
    fused self_attn.qkv_proj            load_weights cuts it into q | k | v before sharding
    fused mlp.gate_up_proj              load_weights cuts it into gate | up before sharding
    LoRA adapters on those fused names  halserve.lora.manager cuts lora_B the same way (fused_checkpoint_modules)
    LongRoPE (short/long factors)       halserve.layers.rotary, rope type "longrope" (older: "su");
                                        which factor set, and where that differs from HF: _longrope_inv_freq
    partial_rotary_factor (Phi-4-mini)  halserve.layers.rotary: rotary_dim = head_size * factor
    sliding_window on every layer       layer_sliding_windows (HF masks every Phi-3 layer with it)

Why cut before sharding: under tensor parallelism each rank needs its own heads of q, of k
and of v (its rows of gate and of up), which are not one contiguous slice of the fused rows

    qkv_proj rows  [ q: Hq*D | k: Hk*D | v: Hk*D ]   rank r takes q[r], k[r], v[r]

so each part goes through the fused layer's weight loader with its shard id, exactly as a
Llama checkpoint's separate q_proj/k_proj/v_proj (gate_proj/up_proj) tensors do.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from halserve.layers import ModelContext
from halserve.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, hf_config: Any, ctx: ModelContext) -> None:
        super().__init__(hf_config, ctx)
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        # The checkpoint's fused modules -> their parts in order: (the Llama checkpoint's module suffix,
        # which STACKED_PARAMS maps onto our fused layer with a shard id; relative size). load_weights
        # cuts weights by it, and halserve.lora.manager cuts LoRA adapters' lora_B the same way.
        self.fused_checkpoint_modules = {
            ".qkv_proj": [(".q_proj", num_heads), (".k_proj", num_kv_heads), (".v_proj", num_kv_heads)],
            ".gate_up_proj": [(".gate_proj", 1), (".up_proj", 1)],
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Rename and cut fused tensors into the per-projection tensors Llama's loader maps back
        onto the fused parameters with shard ids; every other tensor passes through."""
        params = dict(self.named_parameters(remove_duplicate=False))
        for name, tensor in weights:
            fused = next((f for f in self.fused_checkpoint_modules if f"{f}." in name), None)
            param = params.get(name) if fused is not None else None
            output_dim = getattr(param, "output_dim", None)
            if output_dim is None:  # not fused, unknown (Llama's loader reports it), or one value for all parts
                yield name, tensor
                continue
            parts = self.fused_checkpoint_modules[fused]
            # relative sizes, so a quantized tensor whose output dim is packed splits the same way
            total, rows = sum(size for _, size in parts), tensor.shape[output_dim]
            if rows % total:
                raise ValueError(
                    f"checkpoint tensor {name!r} has {rows} rows along dim {output_dim}, which do not split into "
                    f"{' | '.join(p.strip('.') for p, _ in parts)} in the ratio "
                    f"{':'.join(str(s) for _, s in parts)} the config's head counts give; "
                    "does config.json belong to this checkpoint?"
                )
            start = 0
            for part, size in parts:
                length = rows // total * size
                yield name.replace(f"{fused}.", f"{part}."), tensor.narrow(output_dim, start, length)
                start += length

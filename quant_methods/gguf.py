"""GGUF checkpoints with their weights kept in GGUF's quantized blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K),
multiplied by the platform's ``gguf_gemm`` kernel. The default for a ``.gguf`` model; ``--quantization
unquantized`` (or ``none``) dequantizes every tensor to the model dtype at load instead.

    quant_config (built by the loader from the file, halserve.models.gguf.gguf_tensor_types):
        tensor_types   {HF weight name: GGUF type name}, every tensor of the file
    per layer:  weight  uint8 [N_local, row bytes]   the file's rows, block bytes as stored
                (a fused layer whose parts differ in type: each part's rows hold its own type, padded
                to the widest; ``apply`` runs one kernel per run of equal types)

Layers any of whose parts has a type without a kernel here (F16, Q5_0, IQ*, ...) are dequantized at load
and served by the unquantized method. The token embedding and the LM head keep their blocks too where their
type has a kernel (``vocab_qtype``; halserve.layers.vocab): lookups dequantize the rows they read, the head
runs ``gguf_gemm``.

Tensor parallelism: column-parallel layers split rows (any type); row-parallel layers split each row's
blocks, which needs the rank's share of the input features to be a whole number of blocks (32 values,
256 for the K types), else loading fails saying so.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from halserve.quant_methods.base import QuantMethod, set_weight_attrs
from halserve.quant_methods.common import checkpoint_names, shard_index

logger = logging.getLogger(__name__)


class GgufLinearMethod(QuantMethod):
    name = "gguf"
    description = "GGUF blocks (Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K) kept quantized, through the gguf_gemm kernel"

    def __init__(self, platform_name: str, quant_config: dict[str, Any] | None = None) -> None:
        super().__init__(platform_name, quant_config)
        self.tensor_types: dict[str, str] = dict(self.quant_config.get("tensor_types") or {})
        # HF weight names the layers built with this method hold as blocks: what the loader keeps quantized
        self.quantized_names: set[str] = set()
        self.dequantized_layers: list[str] = []

    # the HF names of the vocabulary tensors (halserve's models load these names for both roles)
    VOCAB_NAMES = {"embedding": "model.embed_tokens.weight", "lm_head": "lm_head.weight"}

    def vocab_qtype(self, role: str) -> str | None:
        """Called by ``VocabParallelEmbedding`` / ``ParallelLMHead`` at construction (``role`` ``"embedding"``
        or ``"lm_head"``): the GGUF type whose blocks the layer keeps, the loader then streaming them raw;
        None: the file stores it as floats (F32, F16) or in a type without a kernel, dequantized at load."""
        from halserve.kernels.gguf_blocks import GGUF_BLOCKS

        name = self.VOCAB_NAMES[role]
        qtype = self.tensor_types.get(name)
        if qtype not in GGUF_BLOCKS:
            return None
        self.quantized_names.add(name)
        return qtype

    def part_names(self, prefix: str) -> list[str]:
        """The checkpoint weights of layer ``prefix``: itself when the file stores it whole (Phi-3's
        ``qkv_proj``), else the parts halserve fuses (``q_proj``, ``k_proj``, ``v_proj``)."""
        if f"{prefix}.weight" in self.tensor_types:
            return [f"{prefix}.weight"]
        return [f"{name}.weight" for name in checkpoint_names(prefix)]

    def get_method_for_layer(self, prefix: str) -> QuantMethod:
        from halserve.kernels.gguf_blocks import GGUF_BLOCKS
        from halserve.quant_methods.unquantized import UnquantizedLinearMethod

        names = self.part_names(prefix)
        types = [self.tensor_types.get(name) for name in names]
        if not all(t in GGUF_BLOCKS for t in types):
            self.dequantized_layers.append(f"{prefix} ({'/'.join(str(t) for t in types)})")
            return UnquantizedLinearMethod(self.platform_name)
        self.quantized_names.update(names)
        return self

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        from halserve.kernels.gguf_blocks import GGUF_BLOCKS, row_bytes

        names = self.part_names(layer.prefix)
        types = [self.tensor_types[name] for name in names]
        sizes = layer.output_partition_sizes if len(names) > 1 else [output_size]
        if len(sizes) != len(names):
            raise ValueError(f"{layer.prefix}: {len(names)} GGUF tensors ({', '.join(names)}) for "
                             f"{len(sizes)} output parts")
        widths = []
        for qtype in types:
            block = GGUF_BLOCKS[qtype][0]
            if input_size % block:
                raise ValueError(
                    f"{layer.prefix}: {input_size} input features per tensor-parallel rank is not a whole number of "
                    f"{qtype} blocks ({block} values); use a tensor-parallel size that keeps blocks whole, or "
                    "--quantization unquantized to dequantize the GGUF weights at load")
            widths.append(row_bytes(qtype, input_size))
        weight = nn.Parameter(torch.zeros(output_size, max(widths), dtype=torch.uint8), requires_grad=False)
        layer.register_parameter("weight", weight)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        # (first local row, rows, GGUF type, bytes per row) of each checkpoint part
        layer.gguf_parts = list(zip(offsets, sizes, types, widths))
        layer.gguf_dtype = params_dtype

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            self._load_part(layer, param, loaded, shard_id)

        set_weight_attrs(weight, {"weight_loader": load})

    @staticmethod
    def _load_part(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any) -> None:
        from halserve.layers.linear import ColumnParallelLinear

        if loaded.dtype != torch.uint8:
            raise ValueError(f"{layer.prefix}: the GGUF method expects the file's raw blocks (uint8), got "
                             f"{loaded.dtype}; the weight was dequantized on the way in")
        index = 0 if len(layer.gguf_parts) == 1 else shard_index(layer, shard_id)
        offset, rows, qtype, width = layer.gguf_parts[index]
        if layer.input_size_per_partition != layer.input_size:  # row-parallel: this rank's blocks of every row
            loaded = loaded.narrow(1, layer.tp_rank * width, width)
        if isinstance(layer, ColumnParallelLinear):
            if shard_id is None or len(layer.gguf_parts) == 1:
                start = layer.tp_rank * rows
            else:
                start = layer._shard_rank_start(shard_id) * rows
            loaded = loaded.narrow(0, start, rows)
        if tuple(loaded.shape) != (rows, width):
            raise ValueError(f"GGUF tensor for {layer.prefix} (part {index}, {qtype}) has shape "
                             f"{tuple(loaded.shape)}, expected {(rows, width)}")
        param.data[offset:offset + rows, :width].copy_(loaded)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from halserve.kernels import resolve_kernel

        runs: list[list] = []  # [first row, rows, type, width]: consecutive parts of one type merged
        for offset, rows, qtype, width in layer.gguf_parts:
            if runs and runs[-1][2] == qtype:
                runs[-1][1] += rows
            else:
                runs.append([offset, rows, qtype, width])
        dtype_name = str(layer.gguf_dtype).replace("torch.", "")
        weight = layer.weight.data
        layer.gguf_runs = []
        for offset, rows, qtype, width in runs:
            kernel = resolve_kernel("gguf_gemm", self.platform_name, dtype=dtype_name, n=rows,
                                    k=layer.input_size_per_partition, qtype=qtype)
            qweight = weight[offset:offset + rows, :width]
            if len(runs) > 1 or width != weight.shape[1]:
                qweight = qweight.contiguous()
            layer.gguf_runs.append((kernel, kernel.prepare_weight(qweight), qtype))
        if len(runs) > 1 or layer.gguf_runs[0][1] is not weight:
            layer.weight.data = torch.empty(0, dtype=torch.uint8, device=weight.device)  # not held twice

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if len(layer.gguf_runs) == 1:
            kernel, qweight, qtype = layer.gguf_runs[0]
            return kernel(x, qweight, qtype, bias)
        out = torch.cat([kernel(x, qweight, qtype) for kernel, qweight, qtype in layer.gguf_runs], dim=-1)
        return out if bias is None else out + bias

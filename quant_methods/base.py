"""The quantization-method interface: how a linear layer's weights are created, fixed
up after loading, and applied.

Who calls what, and when (all at model load except ``apply``):

    ModelContext.quant_method ──get_method_for_layer(prefix)──> method for one layer
    LinearBase.__init__  ──> method.create_weights(layer, input_size, output_size, params_dtype)
    load_weights         ──> param.weight_loader(param, tensor, shard_id)   (set by the layer
                             unless the method attached its own)
    loader, after load   ──> method.process_weights_after_loading(layer)
    every forward        ──> method.apply(layer, x, bias)

``input_size``/``output_size`` given to ``create_weights`` are the *tensor-parallel local*
sizes. Before calling it the layer also sets, for methods that need them:

    layer.input_size_per_partition   int
    layer.output_partition_sizes     list[int]  local size of each logical shard
                                     ([q, k, v] for QKV, [gate, up] for gate_up, else one)
    layer.tp_rank, layer.tp_size     int

Parameter attributes the layer's weight loader understands (set with ``set_weight_attrs``):

    output_dim   int | None   dim split across ranks / shards (column-parallel)
    input_dim    int | None   dim split across ranks (row-parallel)
    packed_dim, pack_factor   the dim stores ``pack_factor`` logical values per element
    optional     bool         the checkpoint may leave it out (the loader then skips it)
    weight_loader             (param, loaded_weight, shard_id) -> None: the method loads it
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # pragma: no cover
    import torch


def set_weight_attrs(param: Any, attrs: dict[str, Any] | None) -> None:
    """Attach loader hints (``output_dim``, ``input_dim``, ...) to a parameter."""
    for key, value in (attrs or {}).items():
        if hasattr(param, key) and key != "weight_loader":
            raise AssertionError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


class QuantMethod:
    """One quantization format for linear layers. Subclasses set ``name`` and fill the
    three hooks. An instance is built once per model by the loader and shared by layers;
    per-layer state lives on the layer (parameters, resolved kernels)."""

    name: ClassVar[str]
    """The ``quantization_config.quant_method`` / ``--quantization`` value it handles."""
    platforms: ClassVar[tuple[str, ...]] = ("*",)
    """Platforms it runs on; ``("*",)`` for any."""
    description: ClassVar[str] = ""

    def __init__(self, platform_name: str, quant_config: dict[str, Any] | None = None) -> None:
        """``platform_name`` picks kernels; ``quant_config`` is the checkpoint's
        ``quantization_config`` dict (None when quantization came from a flag only)."""
        self.platform_name = platform_name
        self.quant_config = dict(quant_config or {})

    @classmethod
    def supports(cls, *, platform: str, dtype: str) -> str | None:
        """``None`` if this method can run on ``platform`` with activations of ``dtype``,
        else a human reason (optional) default: checks ``platforms`` only."""
        if "*" not in cls.platforms and platform not in cls.platforms:
            return f"quantization {cls.name!r} does not run on platform {platform!r} (runs on {', '.join(cls.platforms)})"
        return None

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {"platforms": list(cls.platforms), "description": cls.description}

    def get_method_for_layer(self, prefix: str) -> QuantMethod:
        """The method for the linear layer named ``prefix`` (e.g. ``model.layers.0.mlp.down_proj``)
        (optional) default: self. Formats that leave some layers unquantized
        (``modules_to_not_convert``, ``ignore``) return an ``UnquantizedLinearMethod`` here."""
        return self

    def create_weights(
        self, layer: torch.nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype
    ) -> None:
        """Register the layer's weight parameters (TP-local sizes) on ``layer``."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack/convert the loaded weights (optional) default: nothing."""

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x [M, input_size] -> [M, output_size]`` (``x @ W.T + bias``)."""
        raise NotImplementedError

    # -- MoE experts: halserve's fused MoE holds them in the model dtype, dequantized at load ------
    def expert_weight_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The checkpoint tensors of one MoE expert projection in this format, as (those
        ``dequantize_weight`` needs, those it ignores: e.g. static input scales). Called by the
        expert loader with the method ``get_method_for_layer`` gives the expert's projection
        (``model.layers.0.mlp.experts.3.gate_proj``). Default: the format has no MoE support."""
        raise ValueError(f"quantization {self.name!r} does not support MoE experts yet; serve an unquantized "
                         "checkpoint of this model")

    def dequantize_weight(self, tensors: dict[str, torch.Tensor], input_size: int,
                          output_size: int) -> torch.Tensor:
        """The float weight ``[output_size, input_size]`` that ``tensors`` (named as
        ``expert_weight_names`` says, the whole projection, not a rank's share) stand for."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<quant method {self.name}>"

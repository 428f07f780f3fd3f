"""Quantization methods: how a linear layer's weights are stored, loaded and multiplied.

``base.QuantMethod`` is the interface; the bundled formats (``unquantized``, ``gptq``, ``awq``,
``compressed-tensors``, ``fp8``) register through the ``builtin`` plugin like a vendor's would.
"""
from halserve.quant_methods.base import QuantMethod, set_weight_attrs

__all__ = ["QuantMethod", "set_weight_attrs"]

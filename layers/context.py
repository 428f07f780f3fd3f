"""What layers need to know while a model is being built, passed down explicitly."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:  # pragma: no cover
    from halserve.quant_methods.base import QuantMethod

T = TypeVar("T")


@dataclass
class ModelContext:
    """Layer-construction context: built by the loader, given to the model's __init__.

    Layers resolve their kernels from it once, at construction (never per call).
    """

    platform_name: str  # picks kernels (resolve_kernel's platform)
    dtype: torch.dtype  # parameter / activation dtype
    attn_backend_cls: type  # AttentionBackend subclass each Attention layer instantiates
    kv_cache_dtype: str = "auto"
    quant_method: QuantMethod | None = None  # None = unquantized
    max_position: int | None = None  # rotary cache length; None = the model's max_position_embeddings
    # built-in layer class -> (the platform plugin's replacement, plugin name); None until the first
    # ``layer()`` call reads the registry (once per model build; shared by ``without_quantization``)
    layer_overrides: dict[type, tuple[type, str]] | None = None

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")

    def layer(self, base: Callable[..., T]) -> Callable[..., T]:
        """What a model calls to build a ``base`` layer (``ctx.layer(RMSNorm)(hidden, eps, ctx)``):
        the replacement a plugin registered for this platform (``halserve_layer_overrides``), else
        ``base`` itself (``halserve.layers.factory``)."""
        from halserve.layers.factory import layer_class, layer_overrides

        if self.layer_overrides is None:
            self.layer_overrides = layer_overrides(self.platform_name)
        return layer_class(base, self.layer_overrides)

    def without_quantization(self) -> ModelContext:
        """This context for layers a quantized checkpoint leaves in floats (MoE routers, vision towers)."""
        import dataclasses

        return dataclasses.replace(self, quant_method=None)

    def linear_method(self, prefix: str) -> QuantMethod:
        """The quant method for the linear layer named ``prefix``."""
        if self.quant_method is None:
            from halserve.quant_methods.unquantized import UnquantizedLinearMethod

            self.quant_method = self.layer(UnquantizedLinearMethod)(self.platform_name)
        return self.quant_method.get_method_for_layer(prefix)

"""Plugin API 2: per-platform replacements of built-in layer classes and model architectures.

    halserve_layer_overrides() -> [LayerOverride(replaces=RMSNorm, cls=AcmeRMSNorm, platform="acme")]
        checked here when registered (check_layer_override), keyed "<platform>/<built-in name>"
    halserve_model_architectures() -> {"LlamaForCausalLM": ModelArchitecture("pkg:AcmeLlama",
                                                                            platform="acme", override=True)}
        registered as a variant keyed "<platform>/<architecture>"; the unscoped registry is untouched

Models build their layers through ``ModelContext.layer(Base)`` (``halserve.layers.context``), which
looks the platform's overrides up once per model build; the step loop calls the built modules
directly, so an override costs nothing per step. This module imports no torch: the built-in classes
are named by dotted path and imported only when a plugin's override is checked.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# The built-in classes a platform may replace: name -> "module:Class".
OVERRIDABLE_LAYERS: dict[str, str] = {
    "ColumnParallelLinear": "halserve.layers.linear:ColumnParallelLinear",
    "MergedColumnParallelLinear": "halserve.layers.linear:MergedColumnParallelLinear",
    "QKVParallelLinear": "halserve.layers.linear:QKVParallelLinear",
    "RowParallelLinear": "halserve.layers.linear:RowParallelLinear",
    "ReplicatedLinear": "halserve.layers.linear:ReplicatedLinear",
    "UnquantizedLinearMethod": "halserve.quant_methods.unquantized:UnquantizedLinearMethod",
    "Fp8LinearMethod": "halserve.quant_methods.fp8:Fp8LinearMethod",
    "GptqLinearMethod": "halserve.quant_methods.gptq:GptqLinearMethod",
    "AwqLinearMethod": "halserve.quant_methods.awq:AwqLinearMethod",
    "CompressedTensorsMethod": "halserve.quant_methods.compressed_tensors:CompressedTensorsMethod",
    "FusedMoE": "halserve.layers.fused_moe:FusedMoE",
    "RMSNorm": "halserve.layers.layernorm:RMSNorm",
    "GemmaRMSNorm": "halserve.layers.layernorm:GemmaRMSNorm",
    "RotaryEmbedding": "halserve.layers.rotary:RotaryEmbedding",
    "MRotaryEmbedding": "halserve.layers.rotary:MRotaryEmbedding",
    "VocabParallelEmbedding": "halserve.layers.vocab:VocabParallelEmbedding",
    "ParallelLMHead": "halserve.layers.vocab:ParallelLMHead",
    "Sampler": "halserve.sampling.sampler:Sampler",
}

# Methods whose arguments are part of a layer's contract: the model, the loader or the runner calls
# them. A replacement may redefine them, keeping the built-in's argument names and kinds.
CONTRACT_METHODS = (
    "forward", "__call__", "compute_logits", "sample",  # called by the model / runner
    "weight_loader", "load_weights", "process_weights_after_loading",  # called by the loader
    "create_weights", "apply", "get_method_for_layer", "expert_weight_names",  # quant methods
)


class LayerOverrideError(TypeError):
    """A layer override or model variant that breaks the contract of what it replaces."""


@dataclass(frozen=True, slots=True)
class LayerOverride:
    """One replacement class, returned by a plugin's ``halserve_layer_overrides`` hook."""

    replaces: type  # the built-in class (one of OVERRIDABLE_LAYERS), e.g. halserve.layers.RMSNorm
    cls: type  # a subclass of ``replaces``, with its constructor signature and weight names
    platform: str  # the platform whose models get ``cls`` instead of ``replaces`` (never "*")

    @property
    def key(self) -> str:
        """The registry name: ``"<platform>/<built-in class name>"``."""
        return f"{self.platform}/{self.replaces.__name__}"


@dataclass(frozen=True, slots=True)
class ModelArchitecture:
    """A value of ``halserve_model_architectures``' dict that replaces a built-in architecture on
    one platform: ``{"LlamaForCausalLM": ModelArchitecture("pkg.mod:AcmeLlama", platform="acme",
    override=True)}``. A plain ``"module:Class"`` string registers a new architecture everywhere."""

    target: str | type  # "module.path:ClassName" (imported on use) or the class
    platform: str | None = None  # the only platform that gets this implementation
    override: bool = False  # must be True: replacing an architecture is always declared


def builtin_class(name: str) -> type:
    module, _, attr = OVERRIDABLE_LAYERS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def _no_arguments(self) -> None:  # what object.__init__ means for a class that defines none
    pass


def _params(fn: Any) -> list[tuple[str, Any, Any]]:
    """(name, kind, default) of each parameter, annotations left out (they may be strings)."""
    fn = _no_arguments if fn is object.__init__ else fn
    try:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]
    except (TypeError, ValueError):  # a builtin without a signature
        return []


def _show(fn: Any) -> str:
    fn = _no_arguments if fn is object.__init__ else fn
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return "(?)"
    return "(" + ", ".join(str(p.replace(annotation=inspect.Parameter.empty)) for p in sig.parameters.values()) + ")"


def check_layer_override(plugin: str, override: Any) -> LayerOverride:
    """The override if it honours the built-in's contract, else ``LayerOverrideError`` naming the
    plugin, the layer and the mismatch: a subclass of a replaceable built-in, scoped to one
    platform, with the built-in's constructor signature, the argument names of every contract
    method it redefines, and the built-in's ``weight_names`` if it declares them."""
    if not isinstance(override, LayerOverride):
        raise LayerOverrideError(
            f"plugin {plugin!r}: halserve_layer_overrides returned {override!r}; return "
            "halserve.plugins.LayerOverride(replaces=<built-in class>, cls=<your class>, platform=<name>) items"
        )
    base, cls, platform = override.replaces, override.cls, override.platform
    where = f"plugin {plugin!r}: layer override {getattr(cls, '__name__', cls)!r}"
    name = getattr(base, "__name__", None)
    if name not in OVERRIDABLE_LAYERS or builtin_class(name) is not base:
        raise LayerOverrideError(
            f"{where} replaces {base!r}, which is not a replaceable built-in; replaceable: "
            f"{', '.join(OVERRIDABLE_LAYERS)}"
        )
    where += f" for {name}"
    if not isinstance(platform, str) or not platform or platform == "*":
        raise LayerOverrideError(
            f"{where} has platform {platform!r}; an override applies on one named platform "
            "(platform='acme'), never on every platform"
        )
    where += f" on platform {platform!r}"
    if not isinstance(cls, type) or not issubclass(cls, base) or cls is base:
        raise LayerOverrideError(
            f"{where}: {cls!r} is not a subclass of {base.__module__}.{name}; subclass the built-in "
            "so that it keeps every member the model and the loader use"
        )
    # (through getattr: mypy calls ``cls.__init__`` on a type unsound)
    init, base_init = getattr(cls, "__init__"), getattr(base, "__init__")  # noqa: B009
    if _params(init) != _params(base_init):
        raise LayerOverrideError(
            f"{where}: constructor {cls.__name__}.__init__{_show(init)} does not match "
            f"{name}.__init__{_show(base_init)}; models build the replacement with the built-in's "
            "arguments, so take exactly those (read extra settings from the environment or the platform)"
        )
    for method in CONTRACT_METHODS:
        mine, theirs = getattr(cls, method, None), getattr(base, method, None)
        if theirs is None or mine is theirs or mine is None:
            continue
        if [p[0] for p in _params(mine)] != [p[0] for p in _params(theirs)]:
            raise LayerOverrideError(
                f"{where}: {cls.__name__}.{method}{_show(mine)} does not match {name}.{method}{_show(theirs)}; "
                "keep the built-in's arguments (the model and the loader call it with them)"
            )
    base_names = getattr(base, "weight_names", None)
    if base_names is not None and tuple(getattr(cls, "weight_names", base_names)) != tuple(base_names):
        raise LayerOverrideError(
            f"{where}: weight_names {tuple(getattr(cls, 'weight_names', ()))} differ from {name}'s {tuple(base_names)}; "
            "checkpoints load into the built-in's parameter names"
        )
    return override


def check_weight_names(plugin: str, base: type, layer: Any, reference: Any) -> None:
    """After a replacement was built: its parameters (names and shapes) are the built-in's, built
    with the same arguments (``reference``, on the meta device), so checkpoints load unchanged."""
    mine = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    theirs = {n: tuple(p.shape) for n, p in reference.named_parameters()}
    if mine == theirs:
        return
    missing = sorted(set(theirs) - set(mine))
    extra = sorted(n for n in set(mine) - set(theirs) if not getattr(dict(layer.named_parameters())[n], "optional", False))
    shapes = sorted(f"{n} {mine[n]} vs {theirs[n]}" for n in set(mine) & set(theirs) if mine[n] != theirs[n])
    problems = [f"missing {', '.join(missing)}" if missing else "", f"extra {', '.join(extra)}" if extra else "",
                f"shape {'; '.join(shapes)}" if shapes else ""]
    problems = [p for p in problems if p]
    if problems:
        raise LayerOverrideError(
            f"plugin {plugin!r}: layer override {type(layer).__name__} for {base.__name__} has other weights "
            f"than {base.__name__} built with the same arguments ({'; '.join(problems)}); keep the built-in's "
            "parameter names and shapes (mark a parameter the checkpoint lacks with optional=True)"
        )


def check_model_variant(plugin: str, architecture: str, value: Any) -> ModelArchitecture | None:
    """``None`` for a plain (unscoped) registration; the variant when ``value`` is a
    ``ModelArchitecture`` declaring ``override=True`` on one platform; else a ``LayerOverrideError``."""
    if not isinstance(value, ModelArchitecture):
        return None
    if not value.override:
        raise LayerOverrideError(
            f"plugin {plugin!r}: architecture {architecture!r} is a ModelArchitecture without override=True; "
            "declare override=True with a platform to replace the built-in there, or give a plain "
            "'module:Class' string to register a new architecture"
        )
    if not isinstance(value.platform, str) or not value.platform or value.platform == "*":
        raise LayerOverrideError(
            f"plugin {plugin!r}: architecture {architecture!r} declares override=True with platform "
            f"{value.platform!r}; an override replaces the built-in on one named platform only "
            "(ModelArchitecture(target, platform='acme', override=True))"
        )
    return value


def layer_overrides_for(platform: str) -> dict[type, tuple[type, str]]:
    """``{built-in class: (replacement, plugin)}`` registered for ``platform`` (read once per model build)."""
    import halserve.plugins as plugins  # (through the package attribute, so tests can swap the manager)

    registry = getattr(plugins.get_plugin_manager(), "layer_overrides", None) or ()
    return {reg.obj.replaces: (reg.obj.cls, reg.plugin) for reg in registry if reg.obj.platform == platform}


_suspended_variants: set[str] = set()  # "<platform>/<architecture>" keys the built-in serves for now


@contextlib.contextmanager
def builtin_model(architecture: str, platform: str) -> Iterator[None]:
    """Build the built-in ``architecture`` on ``platform`` inside this block even where a plugin
    registered a variant for it there (the conformance kit's reference run)."""
    key = f"{platform}/{architecture}"
    added = key not in _suspended_variants
    _suspended_variants.add(key)
    try:
        yield
    finally:
        if added:
            _suspended_variants.discard(key)


def model_variant_for(architecture: str, platform: str | None) -> Any | None:
    """The registration of the variant of ``architecture`` declared for ``platform``, or None."""
    if platform is None or f"{platform}/{architecture}" in _suspended_variants:
        return None
    import halserve.plugins as plugins

    registry = getattr(plugins.get_plugin_manager(), "model_variants", None)
    return None if registry is None else registry.get(f"{platform}/{architecture}")

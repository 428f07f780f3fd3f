"""The hooks halserve calls (see halserve's plugins/hookspecs.py). The entry point
``example = "halserve_plugin_example.plugin"`` names this module."""
from __future__ import annotations

from typing import Any

from halserve.plugins import LayerOverride, ModelArchitecture, PluginManifest, hookimpl
from halserve_plugin_example import __version__

MAX_BATCHED_TOKENS = 8192  # what this device's scheduler budget is capped at


@hookimpl
def halserve_manifest() -> PluginManifest:
    # api: the halserve plugin-API versions this release was built and tested against
    return PluginManifest(
        name="example",
        version=__version__,
        api=">=2,<3",  # plugin API 2: layer overrides, model variants, the device communicator
        description="example CPU-backed device: platform example, attention example_attn, gemm example_gemm, "
                    "RMSNorm and LlamaForCausalLM of its own, its communicator",
    )


@hookimpl
def halserve_platforms() -> list[type]:
    from halserve_plugin_example.platform import ExamplePlatform

    return [ExamplePlatform]


@hookimpl
def halserve_attention_backends() -> list[type]:
    from halserve_plugin_example.attention import ExampleAttentionBackend

    return [ExampleAttentionBackend]


@hookimpl
def halserve_kernels() -> list[type]:
    from halserve_plugin_example.kernels import ExampleGemm

    return [ExampleGemm]


@hookimpl
def halserve_layer_overrides() -> list:
    """Models built for platform example get ExampleRMSNorm wherever they would build RMSNorm."""
    from halserve.layers import RMSNorm
    from halserve_plugin_example.layers import ExampleRMSNorm

    return [LayerOverride(replaces=RMSNorm, cls=ExampleRMSNorm, platform="example")]


@hookimpl
def halserve_model_architectures() -> dict:
    """LlamaForCausalLM checkpoints are built as ExampleLlamaForCausalLM on platform example only
    (imported when a checkpoint asks for it); other platforms keep halserve's own."""
    return {"LlamaForCausalLM": ModelArchitecture("halserve_plugin_example.models:ExampleLlamaForCausalLM",
                                                  platform="example", override=True)}


@hookimpl
def halserve_update_config(config: Any, platform: str) -> None:
    """Cap the per-step token budget on this device. Idempotent, and only for our platform."""
    if platform == "example" and config.max_num_batched_tokens > MAX_BATCHED_TOKENS:
        config.max_num_batched_tokens = MAX_BATCHED_TOKENS

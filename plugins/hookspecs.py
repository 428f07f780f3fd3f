# mypy: disable-error-code="empty-body"
# (hookspecs declare a signature and document it; pluggy never runs their bodies)
"""The halserve plugin hooks: the whole contract between halserve and a plugin.

A plugin is a module (or object) named by an entry point in the ``halserve.plugins``
group. It implements some of the hooks below, each decorated with
``halserve.plugins.hookimpl`` (a plain function named like a hook is taken too). A
``halserve_*`` function that is no hook below, or that takes an argument its hook does not
pass, makes halserve refuse the whole plugin (``halserve.plugins.hookimpls``).

Hooks are called through pluggy with keyword arguments only; an implementation may take
any subset of its hook's arguments. Every hook but ``halserve_update_config`` is called
once per process, at discovery, and must not initialise a device or import a vendor
library that is not installed: put such imports inside the methods of the classes you return.

Every plugin must implement ``halserve_manifest``. All other hooks are optional; a hook
returns the objects the plugin contributes, or an empty list / ``None`` for "nothing".
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig
    from halserve.plugins.manifest import PluginManifest

PROJECT = "halserve"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def halserve_manifest() -> PluginManifest:
    """Return this plugin's manifest (name, version, supported plugin-API range).

    Called first. A plugin whose ``api`` range excludes ``halserve.plugins.API_VERSION``
    is refused and none of its other hooks are called.
    """


@hookspec
def halserve_platforms() -> list[type]:
    """Return ``halserve.platforms.Platform`` subclasses this plugin provides.

    Each class has a unique ``name`` (what ``--platform`` takes). The class is
    instantiated only if it is selected; its ``probe()`` is called by ``halserve plugins``
    and by auto-detection, so it must be cheap and never raise.
    """


@hookspec
def halserve_attention_backends() -> list[type]:
    """Return ``halserve.attention_backends.AttentionBackend`` subclasses.

    Each declares its ``name``, the platforms it runs on and the configurations it
    supports. A platform lists the backends it prefers in ``preferred_attention_backends``.
    """


@hookspec
def halserve_kernels() -> list[type]:
    """Return ``halserve.kernels.Kernel`` subclasses: one implementation of one op.

    Each names its ``op`` (see ``halserve.kernels.OPS``), the platforms it runs on and a
    priority; layers resolve the highest-priority kernel whose ``supports()`` accepts the
    problem, once at model load.
    """


@hookspec
def halserve_quant_methods() -> list[type]:
    """Return ``halserve.quant_methods.QuantMethod`` subclasses, keyed by their ``name``
    (the value of ``quantization_config.quant_method`` or ``--quantization``)."""


@hookspec
def halserve_kv_connectors() -> list[type]:
    """Return ``halserve.kv_connectors.KVConnector`` subclasses, keyed by ``name``."""


@hookspec
def halserve_executors() -> list[type]:
    """Return ``halserve.executors.base.Executor`` subclasses, keyed by ``name`` (what
    ``--distributed-executor-backend`` takes)."""


@hookspec
def halserve_model_architectures() -> dict[str, str]:
    """Return ``{architecture: "module.path:ClassName"}`` for HF ``architectures`` names
    this plugin implements. The class is imported only when a checkpoint asks for it.

    (plugin API 2) A value ``halserve.plugins.ModelArchitecture(target, platform="acme",
    override=True)`` replaces that architecture on platform ``acme`` only (other platforms keep the
    built-in); registering a name another plugin registers, without it, is a conflict error.
    """


@hookspec
def halserve_layer_overrides() -> list:
    """(plugin API 2) Return ``halserve.plugins.LayerOverride(replaces=Builtin, cls=Yours,
    platform="acme")`` items: models built for platform ``acme`` get ``Yours`` wherever they would
    build ``Builtin`` (a linear layer or quant method, ``FusedMoE``, a norm, a rotary embedding,
    the vocab embedding or LM head, the ``Sampler``; ``plugins.overrides.OVERRIDABLE_LAYERS``).

    Checked when registered: ``Yours`` subclasses ``Builtin`` and keeps its constructor signature
    and the arguments of the methods the model and loader call; when first built, its parameters
    must have the built-in's names and shapes. A mismatch fails the plugin, naming the layer.
    """


@hookspec
def halserve_load_formats() -> list[type]:
    """(plugin API 2) Return ``halserve.plugins.LoadFormat`` subclasses, keyed by their ``name``: what
    ``--load-format NAME`` (``LLM(load_format=NAME)``) picks to fill a built model's weights.

    halserve's own names (``auto``, ``safetensors``, ``dummy``) are reserved: taking one, or returning
    something that is no ``LoadFormat`` subclass, fails the plugin naming the format. An unknown
    ``--load-format`` lists every registered name.
    """


@hookspec
def halserve_update_config(config: EngineConfig, platform: str) -> None:
    """Adjust an ``EngineConfig`` in place before it is validated.

    Called for every loaded plugin, after the platform is selected and before the
    platform's own ``check_and_update_config``. Must be idempotent: calling it twice
    leaves the same config as calling it once.
    """


@hookspec
def halserve_tool_parsers() -> list[type]:
    """Return ``halserve.entrypoints.openai.tool_parsers.ToolParser`` subclasses, keyed by their
    ``name`` (what ``--tool-call-parser`` takes): formats in which a model writes tool calls.

    Called when the server looks a parser name up (start-up, and ``--tool-call-parser``'s error
    lists every name). A class that is no ``ToolParser`` subclass, has no ``name`` or does not
    implement ``scan`` is an error naming this plugin. (A single file can do the same without
    packaging: ``halserve serve --tool-parser-plugin FILE``.)
    """


@hookspec
def halserve_reasoning_parsers() -> dict[str, object]:
    """Return ``{name: parser}`` for ``--reasoning-parser``: objects with the methods of
    ``halserve.entrypoints.openai.reasoning.ThinkTagParser`` (``reply_start(prompt)`` and
    ``split(text, start, final, exact)``), e.g. ``ThinkTagParser(ReplyStart.MAYBE, "<reason>",
    "</reason>")`` for a model with other tags. Called when the server looks a name up."""

"""What the engine needs of a model class: one Protocol per role or capability.

    ModelModule                 every architecture: built as cls(hf_config, ctx), called per step,
                                its attention layers bound to the KV cache, its weights streamed in
      TextGenerationModel         + compute_logits             (the generate runner; the default)
      SequenceClassificationModel + classify, activate         (*ForSequenceClassification: the pooling runner)
    SupportsPipelineParallel    supports_pipeline_parallel = True: splits into stages (models.pipeline)
    SupportsMultiModal          supports_multimodal = True: images in prompts (multimodal.processing,
                                worker.mm_embeddings)
    SupportsMRoPE               uses_mrope = True: M-RoPE's three position axes (Qwen2-VL)

A capability is declared by its class attribute (``supports_multimodal = True``); the helpers below
(``supports_multimodal(cls_or_model)``, ...) read that flag, so a class that sets it to False, or a
subclass that turns it off, does not have it. Duck typing still works: nothing needs to inherit from
these classes. ``check_architecture`` runs when an architecture is registered (plugins'
``halserve_model_architectures``: classes at once, dotted paths when first imported by
``halserve.models.architecture_class``) and refuses a class missing a member with a ValueError that
names the class and the member.

This module imports neither torch nor a model: the names below are for type checkers only.
"""
from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from halserve.layers import Attention
    from halserve.layers.context import ModelContext
    from halserve.models.pipeline import IntermediateTensors

# Architectures named so are classifiers (transformers' naming): a decoder plus a `score` head.
CLASSIFIER_SUFFIX = "ForSequenceClassification"


@runtime_checkable
class ModelModule(Protocol):
    """Every architecture. The loader builds it as ``cls(hf_config, ctx)`` on the device, then calls
    ``load_weights``; the model runner calls it once per step."""

    def __init__(self, hf_config: Any, ctx: ModelContext) -> None: ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 intermediate_tensors: IntermediateTensors | None = None,
                 inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        """``input_ids`` [T] (or ``inputs_embeds`` [T, H] from ``SupportsMultiModal.embed_input_ids``),
        ``positions`` [T] ([3, T] with M-RoPE) -> the final hidden states [T, H]; before the last pipeline
        stage the stage's ``IntermediateTensors``, which the next stage reads as ``intermediate_tensors``."""
        ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        """(nn.Module's: what ``__call__`` runs)"""
        ...

    @property
    def attention_layers(self) -> list[Attention]:
        """This pipeline stage's attention layers in layer order; the model runner binds each to its
        KV cache tensor."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Consume ``(checkpoint name, tensor)`` pairs (another stage's tensors are skipped); return the
        names of the parameters loaded. The loader refuses a checkpoint that leaves a parameter out."""
        ...


@runtime_checkable
class TextGenerationModel(ModelModule, Protocol):
    """A language model head: the generate runner (sampling, prompt logprobs, embeddings)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [N, H] -> float32 logits [N, vocab] (last pipeline stage)."""
        ...


@runtime_checkable
class SequenceClassificationModel(ModelModule, Protocol):
    """A classifier or reward model (architectures named ``*ForSequenceClassification``): the pooling
    runner; its requests only classify or embed (``halserve.pooling_params.check_task``)."""

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pooled final hidden states [N, H] -> raw class logits [N, num_labels], float32."""
        ...

    def activate(self, logits: torch.Tensor) -> torch.Tensor:
        """The checkpoint's activation (softmax, sigmoid or none) of ``classify``'s logits, per row."""
        ...


@runtime_checkable
class SupportsPipelineParallel(Protocol):
    """Builds only its stage's layers (``halserve.models.pipeline``) and passes ``IntermediateTensors``
    between stages. Without it, ``pipeline_parallel_size`` must be 1."""

    supports_pipeline_parallel: ClassVar[Literal[True]]


@runtime_checkable
class SupportsMultiModal(Protocol):
    """Images in prompts. The class methods run on the processor side, without weights; the others
    in the model runner (docs/multimodal.md)."""

    supports_multimodal: ClassVar[Literal[True]]

    @classmethod
    def image_token_id(cls, hf_config: Any) -> int:
        """The image placeholder token's id (cheap: the config only)."""
        ...

    @classmethod
    def split_image_inputs(cls, hf_config: Any, processed: Mapping[str, torch.Tensor],
                           num_images: int) -> list[dict[str, torch.Tensor]]:
        """The checkpoint's image processor's batched output -> one dict of model inputs per image."""
        ...

    @classmethod
    def num_image_tokens(cls, hf_config: Any, image_inputs: Mapping[str, torch.Tensor]) -> int:
        """How many placeholder tokens one image's inputs become."""
        ...

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Text embeddings [T, H] of ``input_ids`` [T] (first pipeline stage)."""
        ...

    def embed_multimodal(self, items: list[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
        """One [num_image_tokens, H] tensor per item, in the model dtype."""
        ...

    # (optional) IMAGE_PROCESSOR_DEFAULTS: dict[str, Any], settings over the checkpoint's image
    #     processor config; default: none
    # (optional) image_token_wrappers(hf_config, tokenizer) -> (ids before, ids after) each expanded
    #     image run (class method); default: none


@runtime_checkable
class SupportsMRoPE(Protocol):
    """Positions on M-RoPE's three axes (temporal, height, width): [3, T] instead of [T]."""

    uses_mrope: ClassVar[Literal[True]]

    @classmethod
    def mrope_positions(cls, hf_config: Any, token_ids: list[int],
                        image_inputs: list[Mapping[str, torch.Tensor]]) -> tuple[torch.Tensor, int]:
        """A prompt's positions [3, T] and the delta its decode positions continue from."""
        ...


# -- capability flags ---------------------------------------------------------------------------
def supports_pipeline_parallel(model: object) -> bool:
    """Whether ``model`` (a class or an instance) declares ``supports_pipeline_parallel = True``."""
    return getattr(model, "supports_pipeline_parallel", False) is True


def supports_multimodal(model: object) -> bool:
    """Whether ``model`` (a class or an instance) declares ``supports_multimodal = True``."""
    return getattr(model, "supports_multimodal", False) is True


def uses_mrope(model: object) -> bool:
    """Whether ``model`` (a class or an instance) declares ``uses_mrope = True``."""
    return getattr(model, "uses_mrope", False) is True


def is_sequence_classifier(architecture: str) -> bool:
    """Whether the architecture name is a classifier's (transformers' ``*ForSequenceClassification``)."""
    return architecture.endswith(CLASSIFIER_SUFFIX)


# -- conformance ----------------------------------------------------------------------------------
def protocol_members(protocol: type) -> list[str]:
    """The members a class must have to conform to ``protocol`` (its own and its Protocol bases'),
    in declaration order; ``__call__`` only through ``forward`` (nn.Module provides it)."""
    members: dict[str, None] = {}
    for base in reversed(protocol.__mro__):
        if base is object or not getattr(base, "_is_protocol", False) or base is Protocol:
            continue
        for name in (*getattr(base, "__annotations__", {}), *vars(base)):
            if not name.startswith("_"):
                members[name] = None
    return list(members)


def required_protocols(architecture: str, cls: type) -> list[type]:
    """The protocols the class registered for ``architecture`` must meet: its role by name, and the
    capabilities it declares."""
    role = SequenceClassificationModel if is_sequence_classifier(architecture) else TextGenerationModel
    required: list[type] = [role]
    if supports_pipeline_parallel(cls):
        required.append(SupportsPipelineParallel)
    if supports_multimodal(cls):
        required.append(SupportsMultiModal)
    if uses_mrope(cls):
        required.append(SupportsMRoPE)
    return required


def check_architecture(architecture: str, target: object) -> None:
    """Refuse a registration the engine could not use: ValueError naming the class and the member.

    ``target`` is a class (checked now) or a ``"module.path:ClassName"`` string (its syntax is checked
    now, the class when ``halserve.models.architecture_class`` first imports it).
    """
    if not isinstance(architecture, str) or not architecture:
        raise ValueError(f"a model architecture needs a non-empty name (HF config.json 'architectures'), "
                         f"got {architecture!r}")
    if isinstance(target, str):
        module, sep, attr = target.partition(":")
        if not sep or not module or not attr.isidentifier():
            raise ValueError(f"architecture {architecture!r} is registered as {target!r}; give "
                             "'module.path:ClassName' (or the class itself)")
        return
    if not isinstance(target, type):
        raise ValueError(f"architecture {architecture!r} is registered as {target!r} ({type(target).__name__}); "
                         "give a class or a 'module.path:ClassName' string")
    name = f"{target.__module__}.{target.__qualname__}"
    for protocol in required_protocols(architecture, target):
        for member in protocol_members(protocol):
            if not hasattr(target, member):
                raise ValueError(f"model class {name} (architecture {architecture!r}) has no {member!r}, which "
                                 f"{protocol.__name__} requires (halserve.models.interfaces: "
                                 f"{', '.join(protocol_members(protocol))})")
            if member in vars(protocol) and callable(vars(protocol)[member]) and not callable(getattr(target, member)):
                raise ValueError(f"model class {name} (architecture {architecture!r}): {member!r} must be a "
                                 f"method ({protocol.__name__}), got {type(getattr(target, member)).__name__}")
    try:
        inspect.signature(target).bind(None, None)
    except TypeError as exc:
        raise ValueError(f"model class {name} (architecture {architecture!r}) cannot be built as "
                         f"cls(hf_config, ctx), as the loader does: {exc}") from None
    except ValueError:  # (no signature to read: a C-implemented class)
        pass

"""The model protocols (halserve.models.interfaces): every bundled architecture conforms, and a
class missing a member is refused when registered, naming the class and the member."""
from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

import halserve.models as models
from halserve.models.interfaces import (
    ModelModule,
    SequenceClassificationModel,
    SupportsMultiModal,
    TextGenerationModel,
    check_architecture,
    protocol_members,
    required_protocols,
)
from halserve.plugins import PluginManager, PluginManifest, PluginRecord, hookimpl
from halserve.plugins.builtin import halserve_model_architectures as builtin_architectures

BUNDLED = sorted(builtin_architectures())


@pytest.mark.parametrize("architecture", BUNDLED)
def test_every_bundled_architecture_conforms(architecture: str) -> None:
    cls = models.architecture_class(architecture)
    for protocol in required_protocols(architecture, cls):
        missing = [m for m in protocol_members(protocol) if not hasattr(cls, m)]
        assert missing == [], f"{cls.__name__} lacks {missing} of {protocol.__name__}"
    role = SequenceClassificationModel if architecture.endswith("ForSequenceClassification") else TextGenerationModel
    assert role in required_protocols(architecture, cls)


def test_protocol_members_include_bases() -> None:
    assert protocol_members(TextGenerationModel) == ["forward", "attention_layers", "load_weights", "compute_logits"]
    assert "embed_multimodal" in protocol_members(SupportsMultiModal)
    assert "supports_multimodal" in protocol_members(SupportsMultiModal)


class TinyModel(nn.Module):
    """The smallest class that conforms to TextGenerationModel."""

    def __init__(self, hf_config, ctx) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return self.proj(torch.ones(len(input_ids), 2))

    def compute_logits(self, hidden):
        return hidden.float()

    @property
    def attention_layers(self):
        return []

    def load_weights(self, weights):
        return {name for name, _ in weights}


class NoLogits(TinyModel):
    compute_logits = None  # type: ignore[assignment]


class NoAttentionLayers(nn.Module):
    def __init__(self, hf_config, ctx) -> None:
        super().__init__()

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None): ...
    def compute_logits(self, hidden): ...
    def load_weights(self, weights): ...


class HalfMultimodal(TinyModel):
    supports_multimodal = True  # declares the capability, has none of its members


class ZeroArgs(TinyModel):
    def __init__(self) -> None:
        super().__init__(None, None)


def test_a_conforming_class_passes_and_is_an_instance() -> None:
    check_architecture("TinyForCausalLM", TinyModel)
    model = TinyModel(None, None)
    assert isinstance(model, ModelModule) and isinstance(model, TextGenerationModel)
    assert not isinstance(model, SupportsMultiModal)
    assert not models.supports_multimodal(model) and not models.supports_pipeline_parallel(TinyModel)


@pytest.mark.parametrize(("cls", "member"), [
    (NoAttentionLayers, "'attention_layers'"),
    (HalfMultimodal, "'image_token_id'"),
])
def test_a_class_missing_a_member_is_refused_naming_it(cls: type, member: str) -> None:
    with pytest.raises(ValueError) as info:
        check_architecture("BrokenForCausalLM", cls)
    message = str(info.value)
    assert cls.__qualname__ in message and member in message and "BrokenForCausalLM" in message


def test_a_non_callable_method_and_a_bad_constructor_are_refused() -> None:
    with pytest.raises(ValueError, match=r"NoLogits.*'compute_logits' must be a method"):
        check_architecture("BrokenForCausalLM", NoLogits)
    with pytest.raises(ValueError, match=r"ZeroArgs.*cls\(hf_config, ctx\)"):
        check_architecture("BrokenForCausalLM", ZeroArgs)


def test_a_classifier_name_needs_classify_not_compute_logits() -> None:
    with pytest.raises(ValueError, match=r"TinyModel.*'classify'.*SequenceClassificationModel"):
        check_architecture("TinyForSequenceClassification", TinyModel)


@pytest.mark.parametrize("target", ["no_colon.module", "mod:", ":Cls", 42])
def test_malformed_registrations_are_refused(target: object) -> None:
    with pytest.raises(ValueError, match="Tiny"):
        check_architecture("TinyForCausalLM", target)


def _load_plugin(architectures: dict[str, object]) -> tuple[PluginManager, PluginRecord]:
    plugin = types.ModuleType("halserve_interfaces_test_plugin")
    plugin.halserve_manifest = hookimpl(lambda: PluginManifest(name="acme", version="0.1", api=">=1,<2"))
    plugin.halserve_model_architectures = hookimpl(lambda: architectures)
    manager = PluginManager()
    record = PluginRecord(name="acme", target=plugin.__name__, distribution=None)
    manager.load_plugin("acme", plugin, record)
    return manager, record


def test_a_plugin_registering_a_broken_class_fails_naming_class_and_member() -> None:
    manager, record = _load_plugin({"AcmeForCausalLM": TinyModel, "BrokenForCausalLM": NoAttentionLayers})
    assert record.status == "failed"
    assert "NoAttentionLayers" in record.error and "'attention_layers'" in record.error
    assert "AcmeForCausalLM" not in manager.models  # refused whole, as any broken plugin


def test_a_plugin_registering_a_good_class_loads() -> None:
    manager, record = _load_plugin({"AcmeForCausalLM": TinyModel})
    assert record.status == "loaded", record.error
    assert manager.models["AcmeForCausalLM"].obj is TinyModel


def test_a_dotted_path_is_checked_when_first_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("halserve_interfaces_test_models")
    module.Good, module.Broken = TinyModel, NoAttentionLayers
    monkeypatch.setitem(sys.modules, module.__name__, module)
    registered = {"GoodForCausalLM": f"{module.__name__}:Good", "BrokenForCausalLM": f"{module.__name__}:Broken",
                  "GoneForCausalLM": f"{module.__name__}:Gone"}
    monkeypatch.setattr(models, "supported_architectures", lambda: registered)
    assert models.architecture_class("GoodForCausalLM") is TinyModel
    with pytest.raises(ValueError, match=r"NoAttentionLayers.*'attention_layers'"):
        models.architecture_class("BrokenForCausalLM")
    with pytest.raises(ValueError, match=r"'GoneForCausalLM'.*cannot be imported"):
        models.architecture_class("GoneForCausalLM")
    with pytest.raises(ValueError, match=r"'NopeForCausalLM' is not registered; registered: BrokenForCausalLM"):
        models.architecture_class("NopeForCausalLM")

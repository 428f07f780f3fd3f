"""Plugin API 2: layer overrides and model variants scoped to one platform.

A test plugin ("acme", installed through a fake entry point as a vendor's would be) replaces
RMSNorm, the LM head and the Sampler and registers a LlamaForCausalLM variant on the cpu
platform, and registers a second platform ("acme_other", the cpu device under another name)
on which nothing is replaced. Bad overrides are handed to ``PluginManager.load_plugin`` and
must fail the plugin with a message naming it, the layer and the mismatch.
"""
from __future__ import annotations

import contextlib
import io
import json
import types

import pytest
import torch
from model_factory import make_checkpoint
from plugin_test_utils import load_plugin
from torch import nn

from halserve.attention_backends.torch_ref import TorchAttentionBackend
from halserve.config import EngineConfig
from halserve.entrypoints.cli import main
from halserve.layers import ModelContext, ParallelLMHead, RMSNorm
from halserve.layers.fused_moe import FusedMoE
from halserve.models.llama import LlamaForCausalLM
from halserve.models.loader import get_model_info, load_model
from halserve.platforms.cpu import CpuPlatform
from halserve.plugins import (
    LayerOverride,
    LayerOverrideError,
    ModelArchitecture,
    PluginManager,
    PluginManifest,
    PluginRecord,
    hookimpl,
)
from halserve.quant_methods.unquantized import UnquantizedLinearMethod
from halserve.sampling import Sampler


class CountingRMSNorm(RMSNorm):
    """The built-in's numerics, counting its calls (proves the override ran)."""

    calls = 0

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        type(self).calls += 1
        return super().forward(x, residual)


class CountingLMHead(ParallelLMHead):
    calls = 0

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return super().compute_logits(hidden)


class CountingSampler(Sampler):
    built = 0

    def __init__(self) -> None:
        type(self).built += 1
        super().__init__()


class AcmeLlama(LlamaForCausalLM):
    """A vendor's LlamaForCausalLM for its platform (here: the built-in, marked)."""

    is_acme_variant = True


class OtherPlatform(CpuPlatform):
    name = "acme_other"
    priority = -50


def manifest(api: str = ">=2,<3") -> PluginManifest:
    return PluginManifest(name="acme", version="0.1", api=api)


def make_plugin(overrides=None, architectures=None, api: str = ">=2,<3") -> types.ModuleType:
    module = types.ModuleType("halserve_acme_overrides_plugin")
    module.halserve_manifest = hookimpl(lambda: manifest(api))
    if overrides is not None:
        module.halserve_layer_overrides = hookimpl(lambda: list(overrides))
    if architectures is not None:
        module.halserve_model_architectures = hookimpl(lambda: dict(architectures))
    return module


GOOD_OVERRIDES = [
    LayerOverride(replaces=RMSNorm, cls=CountingRMSNorm, platform="cpu"),
    LayerOverride(replaces=ParallelLMHead, cls=CountingLMHead, platform="cpu"),
    LayerOverride(replaces=Sampler, cls=CountingSampler, platform="cpu"),
]
GOOD_ARCHITECTURES = {"LlamaForCausalLM": ModelArchitecture(AcmeLlama, platform="cpu", override=True)}


@pytest.fixture
def acme_installed(install_plugin) -> PluginManager:
    """The good plugin installed through a fake entry point, discovered with builtin and cpu."""
    plugin = make_plugin(GOOD_OVERRIDES, GOOD_ARCHITECTURES)
    plugin.halserve_platforms = hookimpl(lambda: [OtherPlatform])
    return install_plugin(plugin)


def _build(path: str, platform) -> tuple[nn.Module, torch.Tensor]:
    config = EngineConfig(model=path, dtype="float32")
    info = get_model_info(config, platform)
    model = load_model(config, info, platform, TorchAttentionBackend, progress=False)
    return model, info


def test_overrides_run_on_their_platform_only(tmp_path, acme_installed) -> None:
    path = make_checkpoint(tmp_path, "llama", num_layers=2)
    model, _ = _build(path, CpuPlatform())
    assert type(model) is AcmeLlama  # the cpu variant of the architecture
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(type(m) is CountingRMSNorm for m in norms)
    assert type(model.lm_head) is CountingLMHead

    other, _ = _build(path, OtherPlatform())
    assert type(other) is LlamaForCausalLM  # no variant, no override on another platform
    assert all(type(m) is RMSNorm for m in other.modules() if isinstance(m, RMSNorm))
    assert type(other.lm_head) is ParallelLMHead

    # the overrides ran (counters) and, keeping the built-in's numerics, give the same logits
    hidden = torch.randn(3, model.config.hidden_size)
    CountingRMSNorm.calls = CountingLMHead.calls = 0
    with torch.no_grad():
        normed = model.model.norm(hidden)
        logits = model.compute_logits(normed)
        expected = other.compute_logits(other.model.norm(hidden))
    assert CountingRMSNorm.calls == 1 and CountingLMHead.calls == 1
    torch.testing.assert_close(logits, expected)


def test_engine_generation_uses_the_overrides(tmp_path, acme_installed) -> None:
    """Through the engine: the runner's Sampler and the model's norms are the plugin's on cpu."""
    from halserve import LLM, SamplingParams

    path = make_checkpoint(tmp_path, "llama", num_layers=1)
    CountingRMSNorm.calls = CountingLMHead.calls = CountingSampler.built = 0
    # (uni: the worker runs in this process, where the fake entry point is installed)
    llm = LLM(path, platform="cpu", dtype="float32", max_model_len=64, distributed_executor_backend="uni")
    try:
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                           SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert len(out[0].outputs[0].token_ids) == 3
    assert CountingRMSNorm.calls > 0 and CountingLMHead.calls > 0 and CountingSampler.built >= 1


def test_halserve_plugins_lists_overrides_and_variants(acme_installed) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plugins", "--json", "--platform", "cpu"]) == 0
    report = json.loads(out.getvalue())
    rows = {(r["platform"], r["replaces"]): r for r in report["layer_overrides"]}
    assert rows[("cpu", "RMSNorm")]["cls"].endswith("CountingRMSNorm")
    assert rows[("cpu", "RMSNorm")]["replaces_class"] == "halserve.layers.layernorm.RMSNorm"
    assert rows[("cpu", "ParallelLMHead")]["plugin"] == "acme"
    assert report["resolved_layers"]["RMSNorm"].endswith("CountingRMSNorm")
    (variant,) = report["model_variants"]
    assert (variant["architecture"], variant["platform"], variant["plugin"]) == ("LlamaForCausalLM", "cpu", "acme")
    assert variant["replaces"] == "halserve.models.llama:LlamaForCausalLM"
    assert report["resolved_models"]["LlamaForCausalLM"].endswith("AcmeLlama")
    assert report["resolved_models"]["MistralForCausalLM"] == "halserve.models.llama:LlamaForCausalLM"

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plugins", "--json", "--platform", "acme_other"]) == 0
    other = json.loads(out.getvalue())
    assert other["resolved_layers"] == {}
    assert other["resolved_models"]["LlamaForCausalLM"] == "halserve.models.llama:LlamaForCausalLM"

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plugins", "--platform", "cpu"]) == 0
    table = out.getvalue()
    assert "Layer overrides" in table and "CountingRMSNorm" in table
    assert "LlamaForCausalLM on cpu:" in table


# -- refused overrides ---------------------------------------------------------------------
class WrongInitNorm(RMSNorm):
    def __init__(self, hidden_size: int, eps: float, ctx: ModelContext, scale: float = 1.0) -> None:
        super().__init__(hidden_size, eps, ctx)


class NotASubclassNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ctx: ModelContext) -> None:
        super().__init__()


class WrongForwardNorm(RMSNorm):
    def forward(self, x, res=None):
        return super().forward(x, res)


class WrongComputeLogitsHead(ParallelLMHead):
    def compute_logits(self, hidden, temperature=1.0):
        return super().compute_logits(hidden)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (LayerOverride(RMSNorm, WrongInitNorm, "cpu"),
         "layer override 'WrongInitNorm' for RMSNorm on platform 'cpu': constructor "
         "WrongInitNorm.__init__(self, hidden_size, eps, ctx, scale=1.0) does not match "
         "RMSNorm.__init__(self, hidden_size, eps, ctx)"),
        (LayerOverride(RMSNorm, NotASubclassNorm, "cpu"),
         "is not a subclass of halserve.layers.layernorm.RMSNorm"),
        (LayerOverride(RMSNorm, WrongForwardNorm, "cpu"),
         "WrongForwardNorm.forward(self, x, res=None) does not match RMSNorm.forward(self, x, residual=None)"),
        (LayerOverride(ParallelLMHead, WrongComputeLogitsHead, "cpu"),
         "WrongComputeLogitsHead.compute_logits(self, hidden, temperature=1.0) does not match"),
        (LayerOverride(RMSNorm, CountingRMSNorm, "*"),
         "has platform '*'; an override applies on one named platform"),
        (LayerOverride(nn.LayerNorm, CountingRMSNorm, "cpu"),
         "which is not a replaceable built-in; replaceable: ColumnParallelLinear"),
        ((RMSNorm, CountingRMSNorm), "return halserve.plugins.LayerOverride("),
    ],
    ids=["init-signature", "not-subclass", "forward-signature", "compute-logits-signature", "unscoped",
         "not-replaceable", "not-a-LayerOverride"],
)
def test_bad_override_fails_the_plugin_naming_it(override, expected: str) -> None:
    mgr, record = load_plugin(make_plugin([override]))
    assert record.status == "failed"
    assert record.error.startswith("LayerOverrideError: plugin 'acme'"), record.error
    assert expected in record.error, record.error
    assert len(mgr.layer_overrides) == 0


def test_extra_weight_is_refused_when_first_built() -> None:
    class ExtraWeightNorm(RMSNorm):
        def __init__(self, hidden_size: int, eps: float, ctx: ModelContext) -> None:
            super().__init__(hidden_size, eps, ctx)
            self.shift = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    ctx = ModelContext("cpu", torch.float32, TorchAttentionBackend,
                       layer_overrides={RMSNorm: (ExtraWeightNorm, "acme")})
    with pytest.raises(LayerOverrideError, match=r"plugin 'acme': layer override ExtraWeightNorm for RMSNorm has "
                                                 r"other weights than RMSNorm .*extra shift"):
        ctx.layer(RMSNorm)(16, 1e-6, ctx)


def test_two_plugins_overriding_one_layer_on_one_platform_conflict() -> None:
    mgr, record = load_plugin(make_plugin(GOOD_OVERRIDES[:1]))
    other = PluginRecord(name="rival", target="rival", distribution=None)
    rival = make_plugin([LayerOverride(RMSNorm, WrongForwardNorm.__base__, "acme")])  # another platform: fine
    rival.halserve_layer_overrides = hookimpl(lambda: [LayerOverride(RMSNorm, CountingRMSNorm, "cpu")])
    mgr.load_plugin("rival", rival, other)
    assert record.status == other.status == "loaded"
    assert any("layer override 'cpu/RMSNorm' is registered by both plugin 'acme' and plugin 'rival'" in c
               for c in mgr.conflicts), mgr.conflicts


def test_unscoped_shadowing_of_an_architecture_stays_a_conflict() -> None:
    mgr = PluginManager()
    builtin = PluginRecord(name="builtin", target="halserve.plugins.builtin", distribution=None)
    import halserve.plugins.builtin as builtin_plugin

    mgr.load_plugin("builtin", builtin_plugin, builtin)
    record = PluginRecord(name="acme", target="acme", distribution=None)
    mgr.load_plugin("acme", make_plugin(architectures={"LlamaForCausalLM": "halserve.models.llama:LlamaForCausalLM"}),
                    record)
    (conflict,) = mgr.conflicts
    assert "model 'LlamaForCausalLM' is registered by both plugin 'builtin' and plugin 'acme'" in conflict
    assert "ModelArchitecture('module:Class', platform=<your platform>, override=True)" in conflict
    assert mgr.models["LlamaForCausalLM"].plugin == "builtin"  # the built-in is not shadowed


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (ModelArchitecture(AcmeLlama, platform="cpu"), "is a ModelArchitecture without override=True"),
        (ModelArchitecture(AcmeLlama, override=True), "declares override=True with platform None"),
        (ModelArchitecture(AcmeLlama, platform="*", override=True), "with platform '*'"),
    ],
    ids=["no-override-flag", "unscoped", "star"],
)
def test_undeclared_or_unscoped_variant_fails_the_plugin(value, expected: str) -> None:
    mgr, record = load_plugin(make_plugin(architectures={"LlamaForCausalLM": value}))
    assert record.status == "failed"
    assert "plugin 'acme': architecture 'LlamaForCausalLM'" in record.error and expected in record.error
    assert len(mgr.model_variants) == 0 and len(mgr.models) == 0


def test_api_1_plugin_loads_under_api_2_with_a_deprecation_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r"declares plugin API >=1,<2, built for API 1; this halserve "
                                                r"provides API 2 .* declare api='>=1,<3'"):
        mgr, record = load_plugin(make_plugin(GOOD_OVERRIDES[:1], api=">=1,<2"))
    assert record.status == "loaded"


def test_plugin_for_api_3_is_refused_naming_both_versions() -> None:
    mgr, record = load_plugin(make_plugin(GOOD_OVERRIDES, api=">=3"))
    assert record.status == "refused"
    assert "supports halserve plugin API >=3" in record.error and "provides plugin API 2" in record.error
    assert len(mgr.layer_overrides) == 0


# -- the conformance kit's layer check -------------------------------------------------------
class DoublingRMSNorm(RMSNorm):
    """Keeps the contract but computes something else: the kit must catch it."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        out = super().forward(x, residual)
        return (out[0] * 2, out[1]) if isinstance(out, tuple) else out * 2


def _kit_manager(name: str, overrides: list[LayerOverride]) -> PluginManager:
    """cpu (for its platform) and one plugin registering ``overrides``."""
    import halserve.platforms.cpu as cpu_plugin

    mgr = PluginManager()
    mgr.load_plugin("cpu", cpu_plugin, PluginRecord(name="cpu", target="cpu", distribution=None))
    record = PluginRecord(name=name, target=name, distribution=None)
    mgr.load_plugin(name, make_plugin(overrides), record)
    mgr.records = [record]
    return mgr


def test_kit_checks_each_override_against_its_builtin_on_the_same_weights() -> None:
    from halserve.plugins.testing import run_conformance

    report = run_conformance("acme", checks=("layers",), manager=_kit_manager("acme", GOOD_OVERRIDES))
    rows = {(r.subject, r.case): r for r in report.results if r.check == "layer"}
    assert rows[("CountingRMSNorm (cpu/RMSNorm)", "vs RMSNorm #0")].status == "passed"
    assert rows[("CountingRMSNorm (cpu/RMSNorm)", "vs RMSNorm #1")].status == "passed"  # the residual form
    assert rows[("CountingLMHead (cpu/ParallelLMHead)", "vs ParallelLMHead #0")].status == "passed"
    assert rows[("CountingSampler (cpu/Sampler)", "vs Sampler #0")].status == "passed"  # greedy rows
    assert rows[("CountingSampler (cpu/Sampler)", "vs Sampler #1")].status == "passed"  # top_k=1 rows
    assert report.ok, report.table()

    bad = _kit_manager("bad", [LayerOverride(RMSNorm, DoublingRMSNorm, "cpu")])
    report = run_conformance("bad", checks=("layers",), manager=bad)
    failed = [r for r in report.results if r.status == "failed"]
    assert len(failed) == 2 and all("DoublingRMSNorm" in r.subject for r in failed), report.table()
    assert "tolerance" in failed[0].detail


class LoopedFusedMoE(FusedMoE):
    """The built-in's contract with its own (slow, per-expert) arithmetic: the kit must pass it."""

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, experts = router_logits.softmax(-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)  # (renormalize=True in the kit's case)
        out = torch.zeros_like(hidden)
        local = self.intermediate_size_per_partition
        for t in range(hidden.shape[0]):
            for w, e in zip(weights[t], experts[t]):
                gate_up = self.w13_weight[e] @ hidden[t]
                act = torch.nn.functional.silu(gate_up[:local]) * gate_up[local:]
                out[t] += w * (self.w2_weight[e] @ act)
        return out


class LastTokenSampler(Sampler):
    """Keeps the contract but always answers the last token id: the kit must catch it."""

    def __call__(self, logits, meta):
        ids, logprobs = super().__call__(logits, meta)
        return torch.full_like(ids, logits.shape[1] - 1), logprobs


def test_kit_checks_fused_moe_and_sampler_overrides() -> None:
    from halserve.plugins.testing import run_conformance

    report = run_conformance("moe", checks=("layers",), manager=_kit_manager("moe", [
        LayerOverride(FusedMoE, LoopedFusedMoE, "cpu")]))
    rows = [r for r in report.results if r.check == "layer"]
    assert [r.status for r in rows] == ["passed"], report.table()

    report = run_conformance("bad", checks=("layers",), manager=_kit_manager("bad", [
        LayerOverride(Sampler, LastTokenSampler, "cpu")]))
    failed = [r for r in report.results if r.status == "failed"]
    assert {r.case for r in failed} == {"vs Sampler #0", "vs Sampler #1"}, report.table()


class TorchMatmulMethod(UnquantizedLinearMethod):
    """The dense method's weights, its own matmul (and no prepacked layout): the kit must pass it."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.nn.functional.linear(x, layer.weight, bias)


class NoBiasMethod(TorchMatmulMethod):
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.nn.functional.linear(x, layer.weight)


def test_kit_checks_a_linear_method_override_inside_a_linear_layer() -> None:
    from halserve.plugins.testing import run_conformance

    report = run_conformance("qm", checks=("layers",), manager=_kit_manager("qm", [
        LayerOverride(UnquantizedLinearMethod, TorchMatmulMethod, "cpu")]))
    rows = [r for r in report.results if r.check == "layer"]
    assert [r.status for r in rows] == ["passed"], report.table()

    report = run_conformance("bad", checks=("layers",), manager=_kit_manager("bad", [
        LayerOverride(UnquantizedLinearMethod, NoBiasMethod, "cpu")]))
    assert [r.status for r in report.results if r.check == "layer"] == ["failed"], report.table()

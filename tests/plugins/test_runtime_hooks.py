"""Plugin API 2 runtime hooks: load formats (``halserve_load_formats``, ``--load-format NAME``), the
platform's device communicator (``Platform.make_device_communicator``) and the conformance kit's
``communicator`` (two gloo ranks) and ``variants`` (greedy vs the built-in) checks.

A test plugin ("acme", installed through a fake entry point as a vendor's would be) registers a load
format reading a ``torch.save`` file, a platform with its own communicator and a LlamaForCausalLM
variant on it. Bad contributions are handed to ``PluginManager.load_plugin`` and must fail the plugin
with a message naming the format and the mismatch.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import types

import pytest
import torch
from model_factory import make_checkpoint
from plugin_test_utils import load_plugin
from safetensors.torch import load_file

from halserve.attention_backends.torch_ref import TorchAttentionBackend
from halserve.config import EngineConfig
from halserve.distributed.communicator import DeviceCommunicator
from halserve.entrypoints.cli import main
from halserve.models.llama import LlamaForCausalLM
from halserve.models.loader import get_model_info, load_model
from halserve.platforms.base import Platform, ProbeResult
from halserve.plugins import (
    LoadFormat,
    ModelArchitecture,
    PluginManager,
    PluginManifest,
    PluginRecord,
    hookimpl,
)

WEIGHTS_FILE = "weights.pt"


class TorchSaveFormat(LoadFormat):
    """``--load-format acme_pt``: the checkpoint's tensors in one ``torch.save`` file."""

    name = "acme_pt"
    description = "one torch.save file of HF-named tensors"
    loads = 0

    def iterate_weights(self, model_path):
        type(self).loads += 1
        yield from torch.load(os.path.join(model_path, WEIGHTS_FILE), weights_only=True).items()


class AcmeCommunicator(DeviceCommunicator):
    """The platform's own ops: counts its all-reduces, the rest is torch.distributed's."""

    def all_reduce(self, x):
        return super().all_reduce(x)


class BrokenCommunicator(DeviceCommunicator):
    def all_gather(self, x, dim=-1):  # ranks in the wrong order
        return super().all_gather(x, dim).flip(dim)

    def send(self, x, dst):  # a corrupted payload
        super().send(x + 1, dst)


class WrongArgsCommunicator(DeviceCommunicator):
    def broadcast(self, x, root=0):  # halserve calls broadcast(x, src)
        return super().broadcast(x, root)


class AcmePlatform(Platform):
    name = "acme"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = -50
    description = "the cpu device under another name, with its own communicator"

    @classmethod
    def _probe(cls) -> ProbeResult:
        return ProbeResult(True, "always (test platform)")

    def memory_info(self, index: int = 0) -> tuple[int, int]:
        return 1 << 30, 1 << 31

    def make_device_communicator(self, group, rank, size):
        return AcmeCommunicator(group, rank, size)


class BrokenPlatform(AcmePlatform):
    name = "acme_broken"

    def make_device_communicator(self, group, rank, size):
        return BrokenCommunicator(group, rank, size)


class WrongArgsPlatform(AcmePlatform):
    name = "acme_wrong_args"

    def make_device_communicator(self, group, rank, size):
        return WrongArgsCommunicator(group, rank, size)


class AcmeLlama(LlamaForCausalLM):
    """A vendor's LlamaForCausalLM for its platform: the built-in's numerics."""


class SkewedLlama(LlamaForCausalLM):
    """Keeps the contract but computes other logits: the kit must catch it."""

    def compute_logits(self, hidden):
        logits = super().compute_logits(hidden)
        return logits + torch.linspace(0, 50, logits.shape[-1], dtype=logits.dtype)


def make_plugin(formats=None, platforms=None, architectures=None) -> types.ModuleType:
    module = types.ModuleType("halserve_acme_runtime_plugin")
    module.halserve_manifest = hookimpl(lambda: PluginManifest(name="acme", version="0.1", api=">=2,<3"))
    if formats is not None:
        module.halserve_load_formats = hookimpl(lambda: list(formats))
    if platforms is not None:
        module.halserve_platforms = hookimpl(lambda: list(platforms))
    if architectures is not None:
        module.halserve_model_architectures = hookimpl(lambda: dict(architectures))
    return module


@pytest.fixture
def acme_installed(install_plugin) -> PluginManager:
    return install_plugin(make_plugin([TorchSaveFormat], [AcmePlatform],
                                      {"LlamaForCausalLM": ModelArchitecture(AcmeLlama, platform="acme", override=True)}))


# -- load formats ---------------------------------------------------------------------------------
def test_a_plugins_load_format_fills_the_model_like_safetensors(tmp_path, acme_installed) -> None:
    from halserve.platforms.cpu import CpuPlatform

    path = make_checkpoint(tmp_path / "st", "llama", num_layers=1)
    torch.save(load_file(os.path.join(path, "model.safetensors")), os.path.join(path, WEIGHTS_FILE))
    platform = CpuPlatform()

    def build(load_format: str):
        config = EngineConfig(model=path, dtype="float32", load_format=load_format)
        return load_model(config, get_model_info(config, platform), platform, TorchAttentionBackend, progress=False)

    TorchSaveFormat.loads = 0
    mine, reference = build("acme_pt"), build("auto")
    assert TorchSaveFormat.loads == 1
    theirs = dict(reference.named_parameters())
    for name, param in mine.named_parameters():
        assert torch.equal(param, theirs[name]), name


def test_unknown_load_format_lists_the_registered_ones(acme_installed) -> None:
    with pytest.raises(ValueError, match=r"load_format 'acme_bin' is not supported; use one of auto, "
                                         r"safetensors, dummy, acme_pt \(halserve's own and those registered"):
        EngineConfig(model="m", load_format="acme_bin")
    assert EngineConfig(model="m", load_format="acme_pt").load_format == "acme_pt"


class NoNameFormat(LoadFormat):
    def iterate_weights(self, model_path):
        return iter(())


class ReservedFormat(NoNameFormat):
    name = "dummy"


class EmptyFormat(LoadFormat):
    name = "acme_empty"


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        (ReservedFormat, "load format ReservedFormat takes the name 'dummy', which is halserve's own"),
        (NoNameFormat, "load format NoNameFormat has no name"),
        (EmptyFormat, "load format 'acme_empty' (EmptyFormat) implements neither iterate_weights nor load_weights"),
        (object, "halserve_load_formats returned <class 'object'>; return subclasses of halserve.plugins.LoadFormat"),
    ],
    ids=["reserved-name", "no-name", "no-method", "not-a-LoadFormat"],
)
def test_bad_load_format_fails_the_plugin_naming_it(fmt, expected: str) -> None:
    mgr, record = load_plugin(make_plugin([fmt]))
    assert record.status == "failed"
    assert record.error.startswith("LoadFormatError: plugin 'acme'") and expected in record.error, record.error
    assert len(mgr.load_formats) == 0


def test_two_plugins_registering_one_load_format_conflict() -> None:
    mgr, record = load_plugin(make_plugin([TorchSaveFormat]))
    rival = PluginRecord(name="rival", target="rival", distribution=None)
    mgr.load_plugin("rival", make_plugin([TorchSaveFormat]), rival)
    assert any("load_format 'acme_pt' is registered by both plugin 'acme' and plugin 'rival'" in c
               for c in mgr.conflicts), mgr.conflicts


# -- listing ---------------------------------------------------------------------------------------
def test_halserve_plugins_lists_load_formats_and_the_platforms_communicator(acme_installed) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plugins", "--json", "--platform", "acme"]) == 0
    report = json.loads(out.getvalue())
    (fmt,) = report["load_formats"]
    assert (fmt["name"], fmt["plugin"], fmt["description"]) == ("acme_pt", "acme", TorchSaveFormat.description)
    platforms = {p["name"]: p for p in report["platforms"]}
    assert platforms["acme"]["device_communicator"].endswith("AcmePlatform.make_device_communicator")
    assert platforms["cpu"]["device_communicator"] == "torch.distributed (gloo)"
    # the variant is scoped to its platform
    assert report["resolved_models"]["LlamaForCausalLM"].endswith("AcmeLlama")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plugins", "--json", "--platform", "cpu"]) == 0
    assert json.loads(out.getvalue())["resolved_models"]["LlamaForCausalLM"] == "halserve.models.llama:LlamaForCausalLM"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plugins"]) == 0
    assert "Load formats" in out.getvalue() and "acme_pt" in out.getvalue()


# -- the conformance kit ---------------------------------------------------------------------------
def _platform_manager(platform: type) -> PluginManager:
    mgr, record = load_plugin(make_plugin(platforms=[platform]))
    assert record.status == "loaded", record.error
    mgr.records = [record]
    return mgr


def test_kit_checks_the_communicator_against_gloo_on_two_ranks() -> None:
    """Every op passes for a communicator that keeps torch.distributed's results; a broken one fails
    the ops it breaks (rank order of all_gather, the payload of send/recv) and only those."""
    from halserve.plugins.testing import run_conformance

    report = run_conformance("acme", checks=("communicator",), manager=_platform_manager(AcmePlatform))
    rows = {r.case: r for r in report.results if r.check == "communicator"}
    assert set(rows) == {"all_reduce", "all_gather dim=0", "all_gather dim=-1", "all_to_all", "broadcast", "send/recv"}
    assert all(r.status == "passed" and r.subject == "acme communicator" for r in rows.values()), report.table()

    report = run_conformance("acme", checks=("communicator",), manager=_platform_manager(BrokenPlatform))
    status = {r.case: r.status for r in report.results if r.check == "communicator"}
    assert status == {"all_reduce": "passed", "all_gather dim=0": "failed", "all_gather dim=-1": "failed",
                      "all_to_all": "passed", "broadcast": "passed", "send/recv": "failed"}, report.table()
    failed = next(r for r in report.results if r.case == "send/recv")
    assert "rank 0:" in failed.detail and "tolerance" in failed.detail
    assert not report.ok

    report = run_conformance("acme", checks=("communicator",), manager=_platform_manager(WrongArgsPlatform))
    (row,) = [r for r in report.results if r.check == "communicator"]
    assert (row.case, row.status) == ("contract", "failed"), report.table()
    assert "WrongArgsCommunicator.broadcast(self, x, root) does not match DeviceCommunicator.broadcast(self, x, src)" \
        in row.detail


@pytest.mark.slow  # four small engines (~3 s)
def test_kit_checks_a_model_variant_greedy_against_the_builtin(install_plugin) -> None:
    from halserve.plugins.testing import run_conformance

    for variant, expected in ((AcmeLlama, "passed"), (SkewedLlama, "failed")):
        mgr = install_plugin(make_plugin(
            platforms=[AcmePlatform],
            architectures={"LlamaForCausalLM": ModelArchitecture(variant, platform="acme", override=True)}))
        report = run_conformance("acme", checks=("variants",), manager=mgr)
        (row,) = [r for r in report.results if r.check == "variant"]
        assert (row.subject, row.case, row.status) == ("LlamaForCausalLM on acme", "greedy vs built-in LlamaForCausalLM",
                                                       expected), report.table()
        assert variant.__name__ in row.detail or "differs from the built-in LlamaForCausalLM on acme" in row.detail

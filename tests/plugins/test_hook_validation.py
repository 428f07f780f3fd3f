"""Every hook goes through pluggy, and a plugin with a bad hook is refused whole.

Plugins here are modules built in the test and handed to ``PluginManager.load_plugin``
(one test goes through discovery with a fake entry point), so no wheel is installed.
"""
from __future__ import annotations

import contextlib
import io
import json
import types

import pytest
from plugin_test_utils import load_plugin

from halserve.entrypoints.cli import main
from halserve.kernels import Kernel
from halserve.platforms.base import Platform, ProbeResult
from halserve.plugins import PluginManager, PluginManifest, PluginRecord, hookimpl


class AcmePlatform(Platform):
    name = "acme_hv"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = -30

    @classmethod
    def _probe(cls) -> ProbeResult:
        return ProbeResult(True, "always")


class AcmeGemm(Kernel):
    op, name, platforms = "gemm", "acme_hv_gemm", ("cpu",)


def manifest(api: str = ">=1,<3") -> PluginManifest:
    return PluginManifest(name="acme", version="0.1", api=api)


def make_plugin(mark: bool = True, **hooks) -> types.ModuleType:
    """A plugin module with ``halserve_manifest``, ``halserve_kernels`` -> [AcmeGemm] and ``hooks``."""
    module = types.ModuleType("halserve_acme_test_plugin")
    wrap = hookimpl if mark else (lambda fn: fn)
    module.halserve_manifest = wrap(lambda: manifest())
    module.halserve_kernels = wrap(lambda: [AcmeGemm])
    for hook, fn in hooks.items():
        setattr(module, hook, wrap(fn) if callable(fn) else fn)
    return module


def assert_refused_whole(mgr: PluginManager, record: PluginRecord) -> None:
    assert record.status == "failed"
    for registry in mgr.registries.values():
        assert registry.by_plugin("acme") == []
    assert mgr.pm.get_plugin("acme") is None  # not left registered with pluggy either
    assert not mgr.implements("acme", "halserve_kernels")


@pytest.mark.parametrize("mark", [True, False], ids=["hookimpl", "unmarked"])
def test_misspelt_hook_refuses_the_plugin_whole(mark: bool) -> None:
    mgr, record = load_plugin(make_plugin(mark, halserve_platfroms=lambda: [AcmePlatform]))
    assert_refused_whole(mgr, record)
    assert record.error.startswith("PluginValidationError: plugin 'acme' defines halserve_platfroms,")
    assert "did you mean halserve_platforms?" in record.error
    assert "acme_hv" not in mgr.platforms and "gemm/acme_hv_gemm" not in mgr.kernels


@pytest.mark.parametrize("mark", [True, False], ids=["hookimpl", "unmarked"])
def test_hook_with_an_argument_the_spec_lacks_refuses_the_plugin_whole(mark: bool) -> None:
    def halserve_platforms(device):
        return [AcmePlatform]

    mgr, record = load_plugin(make_plugin(mark, halserve_platforms=halserve_platforms))
    assert_refused_whole(mgr, record)
    assert "halserve_platforms(device) takes device, which halserve_platforms() does not pass" in record.error
    assert "gemm/acme_hv_gemm" not in mgr.kernels


def test_update_config_with_an_unknown_argument_is_refused() -> None:
    def halserve_update_config(config, platform, model):
        raise AssertionError("never called")

    mgr, record = load_plugin(make_plugin(halserve_update_config=halserve_update_config))
    assert_refused_whole(mgr, record)
    assert "takes model, which halserve_update_config(config, platform) does not pass" in record.error
    mgr.call_update_config(config=object(), platform="cpu")  # the refused plugin is not called


def test_hook_that_is_not_a_function_is_refused() -> None:
    mgr, record = load_plugin(make_plugin(halserve_platforms=[AcmePlatform]))
    assert_refused_whole(mgr, record)
    assert "halserve_platforms is a list, not a function" in record.error


def test_hook_wrapper_is_refused() -> None:
    def halserve_platforms():
        yield
        return [AcmePlatform]

    module = make_plugin()
    module.halserve_platforms = hookimpl(wrapper=True)(halserve_platforms)
    mgr, record = load_plugin(module)
    assert_refused_whole(mgr, record)
    assert "halserve_platforms is a hook wrapper" in record.error


def test_hook_that_raises_leaves_nothing_registered() -> None:
    def halserve_platforms():
        raise OSError("no acme driver")

    mgr, record = load_plugin(make_plugin(halserve_platforms=halserve_platforms))
    assert_refused_whole(mgr, record)
    assert record.error == "OSError: no acme driver"
    assert "no acme driver" in record.traceback


def test_plugin_for_another_api_is_refused_before_its_hooks_are_checked() -> None:
    """A plugin built for a later API may have hooks this halserve does not know: refused, not failed."""
    def halserve_new_in_api_3() -> list[type]:
        return []

    module = make_plugin(halserve_new_in_api_3=halserve_new_in_api_3)
    module.halserve_manifest = hookimpl(lambda: manifest(api=">=3,<4"))
    mgr, record = load_plugin(module)
    assert record.status == "refused"
    assert "supports halserve plugin API >=3,<4" in record.error
    assert mgr.pm.get_plugin("acme") is None and len(mgr.kernels) == 0


def test_optional_unknown_hook_is_accepted() -> None:
    module = make_plugin()
    module.halserve_from_another_plugin = hookimpl(optionalhook=True)(lambda: None)
    mgr, record = load_plugin(module)
    assert record.status == "loaded", record.error


@pytest.mark.parametrize("mark", [True, False], ids=["hookimpl", "unmarked"])
def test_good_plugin_is_dispatched_through_pluggy(mark: bool) -> None:
    """Marked or plain functions named like hooks both load; every hook is a pluggy HookImpl."""
    seen = []

    def halserve_update_config(config, platform):  # takes both arguments, by keyword
        seen.append((config, platform))

    def halserve_model_architectures():
        return {"AcmeForCausalLM": "acme.models:AcmeForCausalLM"}

    mgr, record = load_plugin(make_plugin(
        mark, halserve_platforms=lambda: [AcmePlatform], halserve_update_config=halserve_update_config,
        halserve_model_architectures=halserve_model_architectures,
    ))
    assert record.status == "loaded", record.error
    assert mgr.platforms["acme_hv"].obj is AcmePlatform
    assert mgr.kernels["gemm/acme_hv_gemm"].plugin == "acme"
    assert mgr.models["AcmeForCausalLM"].obj == "acme.models:AcmeForCausalLM"
    impls = {impl.function.__name__ for impl in mgr.pm.hook.halserve_platforms.get_hookimpls()}
    assert impls == {"<lambda>"}
    cfg = object()
    mgr.call_update_config(config=cfg, platform="acme_hv")
    assert seen == [(cfg, "acme_hv")]
    assert mgr.call_plugin_hook("acme", "halserve_update_config", config=cfg, platform="cpu") == []
    assert seen[-1] == (cfg, "cpu")


def test_update_config_may_take_a_subset_of_the_arguments() -> None:
    seen = []
    mgr, record = load_plugin(make_plugin(halserve_update_config=lambda platform: seen.append(platform)))
    assert record.status == "loaded", record.error
    mgr.call_update_config(config=object(), platform="cpu")
    assert seen == ["cpu"]


def test_bad_plugin_is_listed_as_failed_by_halserve_plugins(install_plugin) -> None:
    """Through discovery: a fake entry point naming a plugin with a misspelt hook."""
    mgr = install_plugin(make_plugin(halserve_platfroms=lambda: [AcmePlatform]), must_load=False)
    assert mgr.record("cpu").status == "loaded" and mgr.record("builtin").status == "loaded"
    assert "gemm/acme_hv_gemm" not in mgr.kernels

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plugins", "--json"]) == 0
    plugins = {p["name"]: p for p in json.loads(out.getvalue())["plugins"]}
    assert plugins["acme"]["status"] == "failed"
    assert "halserve_platfroms" in plugins["acme"]["error"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plugins"]) == 0
    assert "plugin 'acme' failed:" in out.getvalue() and "halserve_platfroms" in out.getvalue()

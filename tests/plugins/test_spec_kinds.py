"""KV-cache spec kinds as a plugin surface (issue 29 item 5): a plugin registers a new kind and the
backend serving it; the conformance kit checks every kind a backend claims (the plugin's own check for
its kind, MLA against the torch reference, a windowed forward for sliding_window) and fails a backend
claiming a kind it cannot do. Plugins are module objects loaded in-process (``PluginManager.load_plugin``)."""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F

from halserve.attention_backends.base import AttentionMetadata
from halserve.attention_backends.torch_ref import TorchAttentionBackend
from halserve.kv_cache import spec_kinds as kinds_module
from halserve.kv_cache.spec import FullAttentionSpec, group_layers
from halserve.kv_cache.spec_kinds import known_spec_kinds, register_spec_kind
from halserve.plugins import hookimpl
from halserve.plugins.manager import PluginManager, PluginRecord
from halserve.plugins.manifest import PluginManifest
from halserve.plugins.testing import run_conformance


@pytest.fixture(autouse=True)
def _own_registry(monkeypatch):
    """Each test registers into a copy: the process's registry is as it was afterwards."""
    monkeypatch.setattr(kinds_module, "_REGISTERED", dict(kinds_module._REGISTERED))


@dataclass(frozen=True, slots=True)
class ChunkedLocalSpec:
    """Attention within fixed chunks (Llama 4's local layers): blocks of finished chunks are never read."""

    chunk: int
    kind: ClassVar[str] = "acme_chunked_local"

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.chunk * self.chunk

    def max_num_blocks(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        return min(-(-num_tokens // block_size), -(-(self.chunk + max_step_tokens) // block_size) + 1)


def check_one_prefill(backend_cls: type, device: str) -> str:
    """The acme plugin's conformance check of its kind: one 9-token prefill equals causal SDPA."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, 2, 32, generator=g) for _ in range(3))
    backend = backend_cls(2, 32, 32**-0.5, 2)
    cache = torch.zeros(backend_cls.kv_cache_shape(2, 16, 2, 32)).to(device)
    qsl, sl = torch.tensor([0, 9], dtype=torch.int32), torch.tensor([9], dtype=torch.int32)
    common = AttentionMetadata(num_actual_tokens=9, num_reqs=1, max_query_len=9, max_seq_len=9,
                               query_start_loc=qsl, seq_lens=sl, block_table=torch.tensor([[1]], dtype=torch.int32),
                               slot_mapping=torch.arange(16, 25), query_start_loc_cpu=qsl, seq_lens_cpu=sl)
    out = backend.forward(q.to(device), k.to(device), v.to(device), cache, backend_cls.build_metadata(common))
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          is_causal=True).transpose(0, 1)
    err = (out.cpu() - want).abs().max().item()
    assert err < 1e-5, f"one prefill: max |error| {err:.3g} against causal attention"
    return f"one prefill, max |error| {err:.1e}"


class AcmeAttention(TorchAttentionBackend):
    name = "acme_attn"
    description = "serves acme's chunked local layers"

    @classmethod
    def kv_cache_spec_kinds(cls) -> tuple[str, ...]:
        return ("full_attention", "sliding_window", "acme_chunked_local")


class OffByOnePercent(AcmeAttention):
    name = "acme_attn_wrong"

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs) * 1.01


def make_manager(name: str, backends: list[type], register_kind: bool = True) -> tuple[PluginManager, PluginRecord]:
    plugin = types.ModuleType(f"halserve_spec_kinds_test_{name}")
    plugin.halserve_manifest = hookimpl(lambda: PluginManifest(name=name, version="0.1", api=">=1,<3"))

    def halserve_attention_backends():
        if register_kind:  # where a plugin registers its kind: the hook returning its backend (once)
            register_spec_kind(ChunkedLocalSpec, plugin=name, conformance=check_one_prefill)
        return backends

    plugin.halserve_attention_backends = hookimpl(halserve_attention_backends)
    return load_beside_cpu(name, plugin)


def load_beside_cpu(name: str, plugin) -> tuple[PluginManager, PluginRecord]:
    """A manager holding the cpu plugin (the platform its backends run on here) and ``plugin``."""
    import halserve.platforms.cpu as cpu_plugin

    manager = PluginManager()
    manager.load_plugin("cpu", cpu_plugin, PluginRecord(name="cpu", target="cpu", distribution=None))
    record = PluginRecord(name=name, target=getattr(plugin, "__name__", name), distribution=None)
    manager.load_plugin(name, plugin, record)
    manager.records = [record]
    return manager, record


def rows(report, subject: str) -> dict[str, tuple[str, str]]:
    return {r.case: (r.status, r.detail) for r in report.results if r.subject == subject}


def test_a_plugin_registers_a_kind_and_the_kit_runs_its_check_on_each_claiming_backend():
    manager, record = make_manager("acme", [AcmeAttention, OffByOnePercent])
    assert record.status == "loaded", record.error
    kind = known_spec_kinds()["acme_chunked_local"]
    assert kind.spec_cls is ChunkedLocalSpec and kind.plugin == "acme"
    # the KV-cache manager groups its layers beside full attention like any spec
    groups = group_layers([ChunkedLocalSpec(8), ChunkedLocalSpec(8), ChunkedLocalSpec(8), FullAttentionSpec()])
    assert [(g.spec.kind, g.layer_indices) for g in groups] == [
        ("acme_chunked_local", (0,)), ("acme_chunked_local", (1,)), ("acme_chunked_local", (2,)),
        ("full_attention", (3,))]

    report = run_conformance("acme", checks=("attention",), quick=True, manager=manager)
    good, wrong = rows(report, "acme_attn"), rows(report, "acme_attn_wrong")
    assert good["kind acme_chunked_local"][0] == "passed", good["kind acme_chunked_local"]
    assert good["kind acme_chunked_local"][1].startswith("one prefill, max |error|")
    # torch's MLA is inherited, and not claimed: no mla rows
    assert not any(case.startswith("mla ") for case in good)
    assert all(status == "passed" for status, _ in good.values()), good
    status, detail = wrong["kind acme_chunked_local"]
    assert status == "failed"
    assert "KV-cache kind 'acme_chunked_local' (check of plugin 'acme')" in detail and "against causal" in detail


def test_registering_checks_the_class_and_the_name():
    assert register_spec_kind(ChunkedLocalSpec, plugin="acme") is register_spec_kind(ChunkedLocalSpec, plugin="acme")

    @dataclass(frozen=True)
    class Mla(ChunkedLocalSpec):
        kind: ClassVar[str] = "mla"

    @dataclass(frozen=True)
    class SameName(ChunkedLocalSpec):
        pass

    @dataclass  # (not frozen: unhashable)
    class Mutable:
        kind: ClassVar[str] = "acme_mutable"
        num_skipped_tokens = ChunkedLocalSpec.num_skipped_tokens
        max_num_blocks = ChunkedLocalSpec.max_num_blocks

    @dataclass(frozen=True)
    class NoMethods:
        kind: ClassVar[str] = "acme_bare"

    with pytest.raises(ValueError, match=r"takes the kind 'mla', one of halserve's own"):
        register_spec_kind(Mla, plugin="acme")
    with pytest.raises(ValueError, match=r"plugin 'other'.*already registered by plugin 'acme' for ChunkedLocalSpec"):
        register_spec_kind(SameName, plugin="other")
    with pytest.raises(ValueError, match=r"Mutable.*not hashable; declare it @dataclass\(frozen=True\)"):
        register_spec_kind(Mutable, plugin="acme")
    with pytest.raises(ValueError, match=r"NoMethods.*lacks num_skipped_tokens, max_num_blocks"):
        register_spec_kind(NoMethods, plugin="acme")


class DropsRope(TorchAttentionBackend):
    """Claims mla, but its absorbed/naive MLA forgets the rotary part of the scores."""

    name = "drops_rope"

    def forward_mla(self, q_nope, q_pe, *args, **kwargs):
        return super().forward_mla(q_nope, torch.zeros_like(q_pe), *args, **kwargs)


class NoForwardMla(TorchAttentionBackend):
    name = "no_forward_mla"
    forward_mla = None  # type: ignore[assignment]

    @classmethod
    def kv_cache_spec_kinds(cls) -> tuple[str, ...]:
        return ("full_attention", "mla")


class ClaimsWindowsDeclinesThem(TorchAttentionBackend):
    name = "claims_windows"
    supports_sliding_window = False

    @classmethod
    def kv_cache_spec_kinds(cls) -> tuple[str, ...]:
        return ("full_attention", "sliding_window")


class ClaimsUnknownKind(TorchAttentionBackend):
    name = "claims_unknown"

    @classmethod
    def kv_cache_spec_kinds(cls) -> tuple[str, ...]:
        return ("full_attention", "acme_never_registered")


def test_the_kit_fails_a_backend_claiming_a_kind_it_cannot_do():
    manager, record = make_manager("bad", [DropsRope, NoForwardMla, ClaimsWindowsDeclinesThem, ClaimsUnknownKind],
                                   register_kind=False)
    assert record.status == "loaded", record.error
    report = run_conformance("bad", checks=("attention",), quick=True, manager=manager)
    assert not report.ok

    mla = {case: r for case, r in rows(report, "drops_rope").items() if case.startswith("mla ")}
    assert {case.split()[1] for case, (status, _) in mla.items() if status == "failed"} >= {
        "prefill_only", "decode_only", "prefix_hit_chunked", "mixed"}, mla
    detail = mla["mla mixed float32 block_size=16"][1]
    assert "attention backend drops_rope, case mla mixed" in detail and "tolerance" in detail
    assert all(s == "passed" for case, (s, _) in rows(report, "drops_rope").items() if not case.startswith("mla "))

    status, detail = rows(report, "no_forward_mla")["kind mla"]
    assert status == "failed" and "claims the mla KV-cache kind but has no forward_mla" in detail

    window = [r for case, r in rows(report, "claims_windows").items() if case.startswith("sliding_window")]
    assert window and all(s == "failed" and "claims the sliding_window KV-cache kind" in d for s, d in window)

    status, detail = rows(report, "claims_unknown")["kind acme_never_registered"]
    assert status == "failed" and "which no one registered" in detail and "register_spec_kind" in detail


def test_the_torch_reference_passes_its_mla_kind():
    """The bundled reference claims mla and passes its own MLA check (model dtype and fp8 pages)."""
    import halserve.plugins.builtin as builtin

    manager, _record = load_beside_cpu("builtin", builtin)
    report = run_conformance("builtin", checks=("attention",), quick=True, manager=manager)
    mla = {case: status for case, (status, _) in rows(report, "torch").items() if case.startswith("mla ")}
    assert mla and set(mla.values()) == {"passed"}, mla
    assert any("kv=fp8" in case for case in mla)
    # `halserve plugins --json` shows each backend's kinds (describe())
    from halserve.attention_backends.triton_paged import TritonPagedAttentionBackend

    assert TorchAttentionBackend.describe()["kv_cache_spec_kinds"] == ["full_attention", "sliding_window", "mla"]
    assert "mla" in TritonPagedAttentionBackend.describe()["kv_cache_spec_kinds"]

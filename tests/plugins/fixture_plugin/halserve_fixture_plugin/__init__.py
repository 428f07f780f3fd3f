"""A third-party halserve plugin used by halserve's tests.

It contributes a platform named ``fixture`` (always available, CPU device, gloo, priority
-10 so auto-detection keeps choosing ``cpu``) and an attention backend ``fixture_attn``.

Environment variables, read at import / hook time, make it misbehave on purpose:

- ``HALSERVE_FIXTURE_RAISE=1``: raise at import (halserve must record it as failed).
- ``HALSERVE_FIXTURE_API=">=2,<3"``: the manifest's plugin-API range (default ``>=1,<2``).
- ``HALSERVE_FIXTURE_DUPLICATE=1``: also register a platform named ``cpu`` (a conflict).
"""
from __future__ import annotations

import os

from halserve.attention_backends.base import AttentionBackend
from halserve.platforms.base import Platform, ProbeResult
from halserve.plugins import PluginManifest, hookimpl

__version__ = "0.0.1"

if os.environ.get("HALSERVE_FIXTURE_RAISE") == "1":
    raise RuntimeError("halserve_fixture_plugin was told to fail at import (HALSERVE_FIXTURE_RAISE=1)")


class FixturePlatform(Platform):
    name = "fixture"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = -10  # below cpu (0): never wins auto-detection
    supported_dtypes = ("float32",)
    default_dtype = "float32"
    preferred_attention_backends = ("fixture_attn", "torch")
    description = "test fixture platform (runs on the CPU)"

    @classmethod
    def _probe(cls) -> ProbeResult:
        return ProbeResult(True, "the fixture platform is always available")


class DuplicateCpuPlatform(FixturePlatform):
    name = "cpu"  # clashes with halserve's own cpu platform on purpose
    description = "test fixture: a second platform named 'cpu'"


class FixtureAttentionBackend(AttentionBackend):
    """Runs on the fixture platform; attends through halserve's torch reference backend."""

    name = "fixture_attn"
    platforms = ("fixture",)
    dtypes = ("float32",)
    description = "test fixture backend (delegates to the torch reference backend)"

    def forward(self, q, k, v, kv_cache, metadata, k_scale=1.0, v_scale=1.0):
        from halserve.attention_backends.torch_ref import TorchAttentionBackend

        ref = TorchAttentionBackend(
            self.num_heads, self.head_size, self.scale, self.num_kv_heads,
            self.sliding_window, self.logits_soft_cap, self.kv_cache_dtype,
        )
        return ref.forward(q, k, v, kv_cache, metadata, k_scale, v_scale)


@hookimpl
def halserve_manifest() -> PluginManifest:
    return PluginManifest(
        name="fixture",
        version=__version__,
        api=os.environ.get("HALSERVE_FIXTURE_API", ">=1,<2"),
        description="test fixture: platform 'fixture' and attention backend 'fixture_attn'",
    )


@hookimpl
def halserve_platforms() -> list[type]:
    platforms: list[type] = [FixturePlatform]
    if os.environ.get("HALSERVE_FIXTURE_DUPLICATE") == "1":
        platforms.append(DuplicateCpuPlatform)
    return platforms


@hookimpl
def halserve_attention_backends() -> list[type]:
    return [FixtureAttentionBackend]

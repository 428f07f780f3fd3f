"""Fixtures for engine tests: tiny random-weight checkpoints, made once per session."""
from __future__ import annotations

import pytest
from engine_helpers import ARCH_OVERRIDES


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    from model_factory import make_checkpoint

    cache: dict[str, str] = {}

    def get(arch: str, **overrides) -> str:
        key = arch + repr(sorted(overrides.items()))
        if key not in cache:
            kwargs = dict(ARCH_OVERRIDES.get(arch, {}))
            kwargs.update(overrides)
            cache[key] = make_checkpoint(str(tmp_path_factory.mktemp(arch)), arch, **kwargs)
        return cache[key]

    return get

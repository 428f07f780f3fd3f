"""A tiny Llama checkpoint for the KV-connector tests, made once per session."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    from model_factory import make_checkpoint

    return make_checkpoint(str(tmp_path_factory.mktemp("kv_llama")), "llama", num_layers=2, max_position_embeddings=256)

"""A tiny Llama checkpoint for the KV-connector tests, made once per session, and what a plain engine
(no connector) generates from it for ``test_kv_connectors_engine.PROMPTS``."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    from model_factory import make_checkpoint

    return make_checkpoint(str(tmp_path_factory.mktemp("kv_llama")), "llama", num_layers=2, max_position_embeddings=256)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    from test_kv_connectors_engine import generate

    from halserve import LLM

    llm = LLM(tiny_llama, num_kv_blocks=64)
    try:
        return generate(llm)
    finally:
        llm.llm_engine.shutdown()

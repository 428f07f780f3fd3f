"""``base``: the dense float checkpoint the quantization tests quantize (module-scoped).

``reference_4bit_kernels``: the 4-bit GEMMs pinned to their torch references (exact float32,
``HALSERVE_KERNELS``, inherited by spawned ranks), so a model test checks the format itself; the
CPU's own 4-bit kernels compute in bf16 (see ``test_cpu_int4_kernels_in_a_model``)."""
from __future__ import annotations

import pytest


@pytest.fixture
def reference_4bit_kernels(monkeypatch):
    monkeypatch.setenv("HALSERVE_KERNELS", "gptq_gemm=torch,awq_gemm=torch")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from model_factory import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("base"), "llama", hidden_size=64, intermediate_size=128,
                           num_heads=4, num_kv_heads=2)

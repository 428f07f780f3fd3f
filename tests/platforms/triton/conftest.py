"""Triton kernel tests: interpreted on CPU when no GPU is present, compiled on a GPU.

``TRITON_INTERPRET=1`` must be set before any module that decorates kernels with
``@triton.jit`` is imported, so it is set here, at conftest import. Tests marked ``gpu``
(bf16, fp32->fp8 casts, torch._scaled_mm, engine runs) skip without a GPU; on a GPU the
whole directory runs compiled against the same references.
"""
import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Where the tensors of every test live: kernels run on the GPU, or in the interpreter on CPU.
DEVICE = "cuda" if HAS_GPU else "cpu"


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA or ROCm GPU (torch.cuda.is_available() is False)")
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:  # a conftest hook sees the whole session's items: only touch ours
        if "gpu" in item.keywords and str(item.path).startswith(here):
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    # every test draws the same random inputs whatever ran before it
    torch.manual_seed(0)

"""Shared pytest setup: tests/ on sys.path so helper modules (model_factory) import plainly, and
Triton's interpreter switched on before anything can import triton (CPU-only machines)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# triton.language decorates its own functions (tl.sum, ...) when triton is first imported, in the mode
# TRITON_INTERPRET says then: any test module that imports triton at collection (peft does: transformers
# -> torch._dynamo -> triton) before tests/platforms/triton/conftest.py sets it would leave every interpreted kernel
# failing with "Cannot call @triton.jit'd outside of the scope of a kernel". Set it here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The configs and tokenizers converted from the many small GGUF files the tests write go to one folder per test session
# (halserve.models.gguf.reader keeps them; by default under ~/.cache), not into the home folder's cache.
if "HALSERVE_GGUF_CACHE" not in os.environ:
    import tempfile

    os.environ["HALSERVE_GGUF_CACHE"] = tempfile.mkdtemp(prefix="halserve-test-gguf-")

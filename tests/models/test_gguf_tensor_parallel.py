"""GGUF blocks under tensor parallelism (quant_methods/gguf.py): column-parallel layers split rows, row-parallel
layers split each row's blocks, the vocabulary splits its rows. A tiny Q8_0 GGUF (tests/models/test_gguf_loading.py's
writer) served at TP=2 gives TP=1's greedy tokens; where a rank's share of a row is not whole blocks, loading
fails naming the layer, the type and the way out."""
from __future__ import annotations

import importlib.util
import os

import pytest

gguf = pytest.importorskip("gguf", reason="the GGUF tests need the gguf package (pip install 'halserve[gguf]')")

_spec = importlib.util.spec_from_file_location("gguf_loading_helpers",
                                               os.path.join(os.path.dirname(__file__), "test_gguf_loading.py"))
helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(helpers)


def test_tp2_splits_the_blocks_and_matches_tp1(tmp_path, monkeypatch):
    # o_proj's 64 and down_proj's 128 input features split into 32 and 64 per rank: whole Q8_0 blocks
    path = helpers.write_gguf(str(tmp_path / "q80.gguf"), "llama", qtype=gguf.GGMLQuantizationType.Q8_0)
    batch = helpers.prompts(3)
    # the float reference kernel on both sides: only the all-reduce's summation order differs
    monkeypatch.setenv("HALSERVE_KERNELS", "gguf_gemm=torch")
    tp1 = helpers.halserve_greedy(path, batch, quantization="gguf")
    tp2 = helpers.halserve_greedy(path, batch, quantization="gguf", tensor_parallel_size=2)
    assert tp2 == tp1


def test_tp2_refuses_a_split_inside_a_block(tmp_path, monkeypatch):
    # 96 intermediate features: 3 Q8_0 blocks per down_proj row, 48 values (1.5 blocks) per rank at TP=2
    monkeypatch.setattr(helpers, "INTERMEDIATE", 96)
    path = helpers.write_gguf(str(tmp_path / "i96.gguf"), "llama", qtype=gguf.GGMLQuantizationType.Q8_0)
    with pytest.raises(Exception, match=r"down_proj: 48 input features per tensor-parallel rank is not a whole "
                                        r"number of Q8_0 blocks \(32 values\).*--quantization unquantized"):
        helpers.halserve_greedy(path, helpers.prompts(1), quantization="gguf", tensor_parallel_size=2)

"""GGUF models with their linear weights kept in GGUF blocks (the ``gguf`` quantization method, the default
for a .gguf): tiny files written with the gguf package's writer (tests/models/test_gguf_loading.py's).

- The layers hold the file's raw block rows (uint8), Q/K rows permuted as transformers permutes the floats.
- With the float reference kernel pinned (``HALSERVE_KERNELS=gguf_gemm=torch``), greedy output is
  token-identical to transformers' dequantized model: halserve computes in floats there.
- With the platform's kernel (the CPU's quantizes activations to 8 bits), greedy output is compared with the
  dequantized model's and must mostly agree (tiny random models amplify the 8-bit rounding; the measured
  agreement is asserted, not identity).
- ``--quantization unquantized`` keeps the dequantize-at-load path; a flag of another format is refused."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from halserve.kernels.gguf_blocks import dequantize

gguf = pytest.importorskip("gguf", reason="the GGUF tests need the gguf package (pip install 'halserve[gguf]')")

_spec = importlib.util.spec_from_file_location("gguf_loading_helpers",
                                               os.path.join(os.path.dirname(__file__), "test_gguf_loading.py"))
helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(helpers)
T = gguf.GGMLQuantizationType

CASES = {  # id -> (GGUF architecture, weight type, tied embeddings)
    "llama-q4_1": ("llama", T.Q4_1, False),
    "llama-q4_0-tied": ("llama", T.Q4_0, True),
    "qwen2-q8_0": ("qwen2", T.Q8_0, False),
    "phi3-q8_0": ("phi3", T.Q8_0, False),
}


def _load(path: str, **kwargs):
    from halserve.attention_backends.torch_ref import TorchAttentionBackend
    from halserve.config import EngineConfig
    from halserve.models.loader import get_model_info, load_model
    from halserve.platforms.cpu import CpuPlatform

    config = EngineConfig(model=path, dtype="float32", **kwargs)
    platform = CpuPlatform()
    return load_model(config, get_model_info(config, platform), platform, TorchAttentionBackend, progress=False)


def test_linear_layers_hold_the_files_blocks(tmp_path):
    path = helpers.write_gguf(str(tmp_path / "q41.gguf"), "llama", qtype=T.Q4_1)
    model = _load(path)
    layer = model.model.layers[0]
    qkv, down = layer.self_attn.qkv_proj, layer.mlp.down_proj
    assert qkv.quant_method.name == "gguf" and down.quant_method.name == "gguf"
    reader = gguf.GGUFReader(path)
    raw = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    qweight = qkv.gguf_runs[0][1]
    heads, kv_heads, head_dim = helpers.SHAPES["llama"]
    assert qweight.dtype == torch.uint8 and qweight.shape == ((heads + 2 * kv_heads) * head_dim, 64 // 32 * 20)
    # v is stored as is; q's rows are llama.cpp's rotary permutation undone (rows of blocks move whole)
    v = raw["blk.0.attn_v.weight"]
    assert torch.equal(qweight[-v.shape[0]:], v)
    q = raw["blk.0.attn_q.weight"]
    unpermuted = q.reshape(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(q.shape)
    assert torch.equal(qweight[:q.shape[0]], unpermuted)
    assert torch.equal(down.gguf_runs[0][1], raw["blk.0.ffn_down.weight"])
    # the token embedding and the (untied) LM head hold their blocks too: lookups dequantize the rows they read
    embed, head = model.model.embed_tokens, model.lm_head
    assert torch.equal(embed.weight, raw["token_embd.weight"]) and embed.gguf_qtype == "Q4_1"
    assert torch.equal(head.weight, raw["output.weight"]) and head.gguf_qtype == "Q4_1"
    ids = torch.tensor([0, 5, 307, 5])
    assert torch.equal(embed(ids), dequantize(raw["token_embd.weight"], "Q4_1", 64)[ids])
    hidden = torch.randn(3, 64)
    want = hidden @ dequantize(raw["output.weight"], "Q4_1", 64).t()
    # the head rounds its activations to two int8 levels (x ~ d q + d2 q2): within 1e-3 of max |logit|
    assert (head.compute_logits(hidden) - want).abs().max() <= 1e-3 * want.abs().max()


def test_tied_head_reads_the_embeddings_blocks_and_floats_stay_floats(tmp_path):
    tied = _load(helpers.write_gguf(str(tmp_path / "tied.gguf"), "llama", qtype=T.Q8_0, tied=True))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight and tied.lm_head.gguf_qtype == "Q8_0"
    assert tied.model.embed_tokens.weight.dtype == torch.uint8
    floats = _load(helpers.write_gguf(str(tmp_path / "f32.gguf"), "llama", qtype=T.F32))
    assert floats.model.embed_tokens.weight.dtype == torch.float32 and floats.lm_head.gguf_qtype is None


def test_unquantized_flag_dequantizes_at_load_and_other_formats_are_refused(tmp_path):
    path = helpers.write_gguf(str(tmp_path / "q80.gguf"), "llama", qtype=T.Q8_0)
    model = _load(path, quantization="none")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.quant_method.name == "unquantized"
    with pytest.raises(ValueError, match="--quantization awq does not apply to the GGUF checkpoint"):
        _load(path, quantization="awq")


@pytest.mark.parametrize("case", list(CASES))
def test_float_reference_kernel_is_token_identical_to_transformers(case, tmp_path, monkeypatch):
    arch, qtype, tied = CASES[case]
    path = helpers.write_gguf(str(tmp_path / f"{case}.gguf"), arch, qtype=qtype, tied=tied)
    batch = helpers.prompts()
    monkeypatch.setenv("HALSERVE_KERNELS", "gguf_gemm=torch")
    # (floats throughout: the float32 KV cache, not the float16 one a GGUF model gets by default)
    assert helpers.halserve_greedy(path, batch, quantization="gguf", kv_cache_dtype="float32") == \
        helpers.hf_greedy_gguf(path, batch), case


def test_kept_blocks_get_llama_cpps_float16_kv_cache_by_default(tmp_path, caplog):
    """A GGUF model whose blocks stay quantized, computed in float32, keeps a float16 KV cache by default (as
    llama.cpp does); an explicit setting, a model dequantized at load, a safetensors checkpoint and a backend
    without a float16 cache keep what they had."""
    import logging

    from halserve.config import EngineConfig
    from halserve.models.loader import get_model_info, gguf_kv_cache_default
    from halserve.platforms.cpu import CpuPlatform

    path = helpers.write_gguf(str(tmp_path / "q80.gguf"), "llama", qtype=T.Q8_0)
    platform = CpuPlatform()

    def default(model=path, **kwargs):
        config = EngineConfig(model=model, dtype=kwargs.pop("dtype", "float32"), **kwargs)
        return gguf_kv_cache_default(config, get_model_info(config, platform), platform)

    assert default() == "float16"
    assert default(attention_backend="torch") == "float16"  # (the torch backend takes it too)
    assert default(kv_cache_dtype="float32") is None and default(kv_cache_dtype="bfloat16") is None
    assert default(quantization="unquantized") is None  # floats throughout
    assert default(dtype="bfloat16") is None  # (a bfloat16 model's cache is 16-bit already)
    assert default(attention_backend="ipex") is None  # a backend that does not take it (here: not even present)
    from model_factory import make_checkpoint

    assert default(model=make_checkpoint(str(tmp_path / "st"), "llama")) is None

    batch = helpers.prompts()[:2]
    with caplog.at_level(logging.INFO, logger="halserve"):
        helpers.halserve_greedy(path, batch, max_new_tokens=2, quantization="gguf")
    cache_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache")]
    assert any("auto -> float16" in m for m in cache_lines) and any("torch.float16" in m for m in cache_lines)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="halserve"):
        helpers.halserve_greedy(path, batch, max_new_tokens=2, quantization="gguf", kv_cache_dtype="float32")
    cache_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache")]
    assert cache_lines and all("float16" not in m for m in cache_lines) and any("torch.float32" in m
                                                                               for m in cache_lines)


def test_native_kernel_agrees_with_the_dequantized_model(tmp_path):
    path = helpers.write_gguf(str(tmp_path / "q41.gguf"), "llama", qtype=T.Q4_1)
    batch = helpers.prompts()
    native = helpers.halserve_greedy(path, batch, quantization="gguf")
    dequantized = helpers.halserve_greedy(path, batch, quantization="unquantized")
    same = sum(a == b for x, y in zip(native, dequantized) for a, b in zip(x, y))
    total = sum(len(x) for x in dequantized)
    # the first token of each prompt: no earlier divergence to inherit
    assert sum(x[0] == y[0] for x, y in zip(native, dequantized)) >= len(batch) - 1
    assert same >= 0.5 * total, (same, total)


def test_greedy_rows_take_the_argmax_head_with_the_same_tokens(tmp_path, monkeypatch):
    """Greedy rows without logprobs reach the LM head as argmax-only (``ModelRunner._argmax_rows``), where the cpu
    GGUF head computes one int8 level and recomputes the near ties: the same tokens as the two-level head for 12
    streams (>= ARGMAX_MIN_ROWS rows a step), a partial group of outputs (vocabulary 308); a request that asks for
    logprobs in the same batch keeps the full head for its row and gets the same tokens and log-probs."""
    from halserve import LLM, SamplingParams
    from halserve.platforms.cpu_kernels.native_gguf import NativeGgufGemm
    from halserve.worker.model_runner import ModelRunner

    path = helpers.write_gguf(str(tmp_path / "q80.gguf"), "llama", qtype=T.Q8_0)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 290 + 3 for j in range(3 + i % 5)]} for i in range(12)]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    params = [with_logprobs if i == 5 else greedy for i in range(len(prompts))]
    argmax_rows = []
    original = NativeGgufGemm.argmax_logits

    def counted(self, x, *args):
        argmax_rows.append(x.shape[0])
        return original(self, x, *args)

    monkeypatch.setattr(NativeGgufGemm, "argmax_logits", counted)
    results = {}
    for mode in ("argmax", "full"):
        if mode == "full":
            monkeypatch.setattr(ModelRunner, "_argmax_rows", staticmethod(lambda step: None))
        llm = LLM(path, platform="cpu", dtype="float32", max_model_len=128)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
        results[mode] = ([o.outputs[0].token_ids for o in outs],
                         [[sorted((t, lp.logprob) for t, lp in step.items()) for step in outs[5].outputs[0].logprobs]])
        if mode == "argmax":
            assert argmax_rows and max(argmax_rows) == len(prompts) - 1  # (every greedy row; not the logprobs one)
            argmax_rows.clear()
    assert not argmax_rows  # (the full head only)
    assert results["argmax"] == results["full"]

"""``load_format="dummy"``: random weights of the checkpoint's shapes and dtypes, made on the
device from the seed, with no weights file read (a folder of config.json and a tokenizer)."""
from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from model_factory import make_checkpoint

    return make_checkpoint(str(tmp_path_factory.mktemp("ckpt")), "llama", tie_word_embeddings=False)


@pytest.fixture(scope="module")
def config_only(checkpoint, tmp_path_factory):
    """The checkpoint's folder without its weights: config.json and the tokenizer only."""
    path = str(tmp_path_factory.mktemp("config_only"))
    for f in os.listdir(checkpoint):
        if not f.endswith(".safetensors") and not f.endswith(".index.json"):
            shutil.copy(os.path.join(checkpoint, f), path)
    assert not glob.glob(os.path.join(path, "*.safetensors"))
    return path


def _model(llm):
    return llm.llm_engine.core.executor.worker.model_runner.model


def _llm(path, **kwargs):
    from halserve import LLM

    kwargs.setdefault("dtype", "float32")
    return LLM(path, platform="cpu", max_model_len=128, num_kv_blocks=32, max_num_seqs=4, **kwargs)


def test_dummy_weights_match_the_checkpoints_shapes_and_dtypes(checkpoint, config_only):
    real = {n: (p.shape, p.dtype) for n, p in _model(_llm(checkpoint)).named_parameters()}
    for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model = _model(_llm(config_only, load_format="dummy", dtype=dtype))
        dummy = dict(model.named_parameters())
        assert {n: s for n, (s, _) in real.items()} == {n: p.shape for n, p in dummy.items()}
        for name, param in dummy.items():
            assert param.dtype == torch_dtype, name
            if not param.numel():  # (a CPU kernel that repacked it into its own buffer at load)
                continue
            assert param.abs().max().item() <= 1e-3, name  # the dummy range
            assert param.float().std().item() > 0, f"{name} was left constant"


def test_dummy_weights_are_deterministic_per_seed(config_only):
    from halserve.models.loader import initialize_dummy_weights

    model = _model(_llm(config_only, load_format="dummy", seed=7))
    first = {n: p.detach().clone() for n, p in model.named_parameters()}
    again = _model(_llm(config_only, load_format="dummy", seed=7))
    other = _model(_llm(config_only, load_format="dummy", seed=8))
    for name, param in again.named_parameters():
        assert torch.equal(param, first[name]), name
    assert not any(torch.equal(p, first[n]) for n, p in other.named_parameters() if p.numel())
    # in place, every parameter, and again the same for the same seed
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32))
    assert initialize_dummy_weights(module, seed=7) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    kept = [p.detach().clone() for p in module.parameters()]
    initialize_dummy_weights(module, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(kept, module.parameters()))


def test_dummy_fills_quantized_parameters():
    from halserve.models.loader import initialize_dummy_weights

    module = torch.nn.Module()
    module.qweight = torch.nn.Parameter(torch.zeros(64, 8, dtype=torch.int32), requires_grad=False)
    module.scale = torch.nn.Parameter(torch.zeros(8, dtype=torch.float8_e4m3fn), requires_grad=False)
    assert initialize_dummy_weights(module, seed=0) == {"qweight", "scale"}
    assert module.qweight.unique().numel() > 8
    assert module.scale.float().abs().max().item() > 0


def test_dummy_generates_and_needs_no_weights_file(config_only):
    from halserve import SamplingParams

    outputs = _llm(config_only, load_format="dummy").generate(
        ["hello there", "a b c"], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]
    with pytest.raises(ValueError, match="no usable safetensors weights"):
        _llm(config_only)  # the default load format reads the checkpoint


def test_unknown_load_format_is_refused(config_only):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="load_format 'pt' is not supported"):
        _llm(config_only, load_format="pt")


def test_bench_throughput_runs_on_a_config_only_folder(config_only, tmp_path, capsys):
    import argparse
    import json

    from halserve.bench import throughput

    parser = argparse.ArgumentParser()
    throughput.add_args(parser)
    out = tmp_path / "result.json"
    args = parser.parse_args(["--model", config_only, "--platform", "cpu", "--load-format", "dummy",
                              "--num-prompts", "3", "--input-len", "8", "--output-len", "4", "--dtype", "float32",
                              "--max-model-len", "64", "--num-kv-blocks", "16", "--output-json", str(out)])
    assert throughput.run(args) == 0
    assert json.loads(out.read_text())["num_output_tokens"] == 12
    assert "Throughput:" in capsys.readouterr().out

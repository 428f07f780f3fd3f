"""Quantized checkpoints through the engine and the server, and the errors for what is not served."""
from __future__ import annotations

import json
import os

import pytest
from engine_helpers import generate_ids, greedy_params, hf_greedy
from model_factory import make_checkpoint
from quant_factory import (
    dequantized_hf_model,
    load_halserve,
    make_awq_checkpoint,
    make_ct_checkpoint,
    make_gptq_checkpoint,
)

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')

PROMPTS = [[1, 45, 74, 299, 17, 273, 5, 9, 100, 31, 7, 8, 99, 3], [1, 300, 2, 9], [1, 100, 101, 102, 103]]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("base"), "llama", hidden_size=64, intermediate_size=128)


@pytest.fixture(scope="module")
def gptq(base, tmp_path_factory):
    """A GPTQ act-order checkpoint, and the float checkpoint of the weights it stands for."""
    root = tmp_path_factory.mktemp("gptq")
    path, dequantized = make_gptq_checkpoint(base, str(root / "q"), desc_act=True)
    float_path = str(root / "float")
    dequantized_hf_model(base, dequantized).save_pretrained(float_path)
    return path, float_path


def test_engine_greedy_matches_the_float_model(gptq, reference_4bit_kernels):
    """Through the scheduler: chunked prefill (8-token budget), batched decodes, prefix-cache hits."""
    from halserve import LLM

    path, float_path = gptq
    expected = hf_greedy(float_path, PROMPTS, 6)
    llm = LLM(path, platform="cpu", dtype="float32", block_size=4, max_num_batched_tokens=8, max_model_len=64)
    try:
        assert generate_ids(llm, PROMPTS, greedy_params(6)) == expected
        assert generate_ids(llm, PROMPTS, greedy_params(6)) == expected  # again, from the prefix cache
    finally:
        llm.llm_engine.shutdown()


def test_server_serves_a_quantized_checkpoint(gptq, tmp_path):
    from openai import OpenAI
    from server_utils import ServerProcess

    from halserve import LLM

    path, _ = gptq
    llm = LLM(path, platform="cpu", dtype="float32", max_model_len=64)  # the server's kernels (CPU int4)
    try:
        expected = generate_ids(llm, [PROMPTS[0]], greedy_params(5))[0]
    finally:
        llm.llm_engine.shutdown()
    server = ServerProcess([path, "--dtype", "float32", "--max-model-len", "64", "--served-model-name", "q"],
                           str(tmp_path / "server.log"))
    try:
        server.wait_ready()
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")
        completion = client.completions.create(model="q", prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=0,
                                               extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        assert completion.choices[0].logprobs.tokens == [f"token_id:{t}" for t in expected]
    finally:
        server.stop()


def _edit_quant_config(path: str, **changes) -> str:
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"].update(changes)
    with open(config_path, "w") as f:
        json.dump(config, f)
    return path


def test_unsupported_checkpoints_and_flags_are_refused_clearly(base, tmp_path):
    gptq8, _ = make_gptq_checkpoint(base, str(tmp_path / "gptq8"))
    with pytest.raises(ValueError, match=r"gptq checkpoints with bits=8 are not supported yet \(4-bit only\)"):
        load_halserve(_edit_quant_config(gptq8, bits=8))
    awq, _ = make_awq_checkpoint(base, str(tmp_path / "awq"))
    with pytest.raises(ValueError, match="--quantization gptq does not match the checkpoint's quantization 'awq'"):
        load_halserve(awq, quantization="gptq")
    with pytest.raises(ValueError, match="AWQ version 'gemv' is not supported"):
        load_halserve(_edit_quant_config(awq, version="gemv"))
    with pytest.raises(ValueError, match="--quantization awq needs a checkpoint quantized in that format"):
        load_halserve(base, quantization="awq")
    ct, _ = make_ct_checkpoint(base, str(tmp_path / "ct"), "W4A16")
    group = json.load(open(os.path.join(ct, "config.json")))["quantization_config"]["config_groups"]["group_0"]
    group["weights"]["num_bits"] = 8
    with pytest.raises(ValueError, match=r"compressed-tensors group_0 \(format 'pack-quantized', weights \{type=int, "
                                         r"num_bits=8.* is not supported; halserve serves W4A16"):
        load_halserve(_edit_quant_config(ct, config_groups={"group_0": group}))
    ct2, _ = make_ct_checkpoint(base, str(tmp_path / "ct2"), "W4A16")
    _edit_quant_config(ct2, ignore=["lm_head", "model.layers.0.self_attn.q_proj"])  # but not k_proj, v_proj
    with pytest.raises(ValueError, match=r"halserve fuses .*q_proj \(listed\), .*k_proj \(not listed\).* into "
                                         r"model.layers.0.self_attn.qkv_proj"):
        load_halserve(ct2)


def test_gptq_without_g_idx_loads_unless_act_order(base, tmp_path):
    from safetensors.torch import load_file, save_file

    for desc_act in (False, True):
        path, _ = make_gptq_checkpoint(base, str(tmp_path / f"gptq-{desc_act}"), desc_act=desc_act)
        file = os.path.join(path, "model.safetensors")
        save_file({k: v for k, v in load_file(file).items() if not k.endswith(".g_idx")}, file)
        if desc_act:
            with pytest.raises(ValueError, match="has no weights for: .*qkv_proj.g_idx"):
                load_halserve(path)
        else:
            assert load_halserve(path).model.layers[0].self_attn.qkv_proj.g_idx is None


def test_plugins_lists_the_quantization_methods():
    from halserve.plugins import get_plugin_manager

    names = set(get_plugin_manager().quant_methods.names())
    assert {"unquantized", "gptq", "awq", "compressed-tensors", "fp8"} <= names


def test_lora_on_a_quantized_base(gptq, tmp_path, reference_4bit_kernels):
    """A PEFT adapter (trained on the float model) served on the GPTQ base gives the tokens of the
    float model the checkpoint stands for with the adapter merged in."""
    from lora_factory import make_adapter, merge_adapter

    from halserve import LLM, LoRARequest

    path, float_path = gptq
    adapter = make_adapter(tmp_path / "adapter", path, r=8, lora_alpha=16, seed=1)
    expected = hf_greedy(merge_adapter(float_path, adapter, tmp_path / "merged"), PROMPTS, 6)
    llm = LLM(path, platform="cpu", dtype="float32", max_model_len=64, enable_lora=True, max_lora_rank=8)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy_params(6), use_tqdm=False,
                            lora_request=LoRARequest("a", 1, adapter))
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert generate_ids(llm, PROMPTS, greedy_params(6)) != expected  # the adapter matters
    finally:
        llm.llm_engine.shutdown()

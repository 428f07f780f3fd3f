"""Quantized MoE checkpoints: each expert projection is written in its format (as GPTQModel,
AutoAWQ and fp8 tools write them, one ``experts.{e}.{proj}`` at a time) and dequantized at load
into the fused experts; the other layers stay quantized. The logits must be those of the float
model the checkpoint stands for. Also: every format's ``dequantize_weight`` against what its
tensors stand for, on the dense checkpoints of the quantization tests."""
from __future__ import annotations

import math

import pytest
import torch
from model_factory import _randomize, make_tokenizer
from quant_factory import (
    dequantized_hf_model,
    load_halserve,
    make_awq_checkpoint,
    make_ct_checkpoint,
    make_fp8_checkpoint,
    make_gptq_checkpoint,
)
from test_quantized_models import fp8_per_group, fp8_per_token, reference_steps, run_steps, with_input_quant

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')

VOCAB, HIDDEN = 512, 64
MOE = {  # arch -> (transformers config, architecture, its defaults)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=32, intermediate_size=96, head_dim=32)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, intermediate_size=32)),
}


@pytest.fixture(scope="module")
def moe_base(tmp_path_factory):
    import transformers
    from transformers import GenerationConfig

    tokenizer = make_tokenizer(VOCAB)
    paths = {}
    for arch, (config_name, architecture, defaults) in MOE.items():
        config = getattr(transformers, config_name)(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            num_experts_per_tok=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, initializer_range=1 / math.sqrt(HIDDEN), **defaults)
        config.architectures = [architecture]
        torch.manual_seed(0)
        model = getattr(transformers, architecture)(config).to(torch.float32)
        _randomize(model, HIDDEN, 0)
        model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
        paths[arch] = str(tmp_path_factory.mktemp(arch))
        model.save_pretrained(paths[arch], safe_serialization=True)  # per-expert tensors
        tokenizer.save_pretrained(paths[arch])
    return paths


def dense_names(dequantized):
    return [n for n in dequantized if ".experts." not in n]


# name -> (checkpoint builder, reference builder(base, dequantized))
CASES = {
    "gptq": (lambda b, o: make_gptq_checkpoint(b, o), dequantized_hf_model),
    "gptq-act-order": (lambda b, o: make_gptq_checkpoint(b, o, desc_act=True), dequantized_hf_model),
    "awq": (lambda b, o: make_awq_checkpoint(b, o), dequantized_hf_model),
    # fp8: the dense layers quantize their activations; the experts run in floats (dequantized)
    "fp8-dynamic": (lambda b, o: make_fp8_checkpoint(b, o),
                    lambda b, d: with_input_quant(dequantized_hf_model(b, d), dense_names(d), fp8_per_token)),
    "fp8-block": (lambda b, o: make_fp8_checkpoint(b, o, block_size=(32, 32)),
                  lambda b, d: with_input_quant(dequantized_hf_model(b, d), dense_names(d), fp8_per_group(32))),
}


@pytest.mark.parametrize("arch", list(MOE))
@pytest.mark.parametrize("case", list(CASES))
def test_quantized_moe_checkpoint_matches_its_float_model(moe_base, tmp_path, arch, case, reference_4bit_kernels):
    build, reference = CASES[case]
    path, dequantized = build(moe_base[arch], str(tmp_path / case))
    assert any(".experts.3." in name for name in dequantized)  # (the experts were quantized)
    model = load_halserve(path)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.quant_method.name != "unquantized"  # the rest stays quantized
    assert layer.mlp.experts.w13_weight.dtype == torch.float32 and layer.mlp.gate.quant_method.name == "unquantized"
    hf = reference(moe_base[arch], dequantized)
    tolerance = 1e-3 if "fp8" in case else 1e-4
    torch.testing.assert_close(run_steps(model), reference_steps(hf), atol=tolerance, rtol=1e-4)


def test_a_format_without_moe_support_is_refused_at_load(moe_base, tmp_path):
    from halserve.quant_methods import gptq
    from halserve.quant_methods.base import QuantMethod

    path, _ = make_gptq_checkpoint(moe_base["qwen3_moe"], str(tmp_path / "gptq"))
    saved = gptq.GptqLinearMethod.expert_weight_names
    gptq.GptqLinearMethod.expert_weight_names = QuantMethod.expert_weight_names
    try:
        with pytest.raises(ValueError, match="quantization 'gptq' does not support MoE experts yet"):
            load_halserve(path)
    finally:
        gptq.GptqLinearMethod.expert_weight_names = saved


DENSE_CASES = {
    "gptq": lambda b, o: make_gptq_checkpoint(b, o, desc_act=True),
    "awq": lambda b, o: make_awq_checkpoint(b, o),
    "fp8": lambda b, o: make_fp8_checkpoint(b, o),
    "fp8-block": lambda b, o: make_fp8_checkpoint(b, o, block_size=(32, 32)),
    "ct-w4a16": lambda b, o: make_ct_checkpoint(b, o, "W4A16"),
    "ct-w4a16-asym": lambda b, o: make_ct_checkpoint(b, o, "W4A16_ASYM"),
    "ct-w8a8-int8": lambda b, o: make_ct_checkpoint(b, o, "W8A8"),
    "ct-fp8": lambda b, o: make_ct_checkpoint(b, o, "FP8"),
    "ct-fp8-block": lambda b, o: make_ct_checkpoint(b, o, "FP8_BLOCK"),
}


@pytest.mark.parametrize("case", list(DENSE_CASES))
def test_dequantize_weight_gives_what_the_tensors_stand_for(base, tmp_path, case):
    """For each format: the method of a layer, given that layer's checkpoint tensors, returns the
    float weight the factory (or compressed-tensors' own decompression) says they stand for."""
    import os

    from safetensors import safe_open

    path, dequantized = DENSE_CASES[case](base, str(tmp_path / case))
    model = load_halserve(path)
    methods = {"model.layers.0.mlp.down_proj": model.model.layers[0].mlp.down_proj.quant_method,
               "model.layers.1.self_attn.q_proj": model.model.layers[1].self_attn.qkv_proj.quant_method}
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        for layer, layer_method in methods.items():
            assert layer_method.name != "unquantized"
            needed, _ = layer_method.expert_weight_names()
            tensors = {n: f.get_tensor(f"{layer}.{n}") for n in needed if f"{layer}.{n}" in names}
            want = dequantized[layer]
            got = layer_method.dequantize_weight(tensors, want.shape[1], want.shape[0])
            torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=1e-3)


def test_quantized_moe_through_the_engine_with_two_tensor_parallel_ranks(moe_base, tmp_path, reference_4bit_kernels):
    """The engine (offline LLM): one rank and two ranks (each holding half of every expert's
    dequantized intermediate rows) give the same greedy tokens."""
    from halserve import LLM, SamplingParams

    path, _ = make_gptq_checkpoint(moe_base["qwen3_moe"], str(tmp_path / "gptq"), desc_act=True)
    prompts = [[1, 45, 74, 299, 17, 273, 5, 9, 100], [1, 300, 2, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = []
    for tp in (1, 2):
        llm = LLM(path, dtype="float32", tensor_parallel_size=tp, num_kv_blocks=64)
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            tokens.append([o.outputs[0].token_ids for o in outputs])
        finally:
            llm.llm_engine.shutdown()
    assert tokens[0] == tokens[1]

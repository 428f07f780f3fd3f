"""The Transformers modeling backend (``--model-impl``, halserve.models.transformers_backend): through
the whole engine (LLM, CPU platform, float32, tiny random checkpoints written by transformers), greedy
output is token-identical to transformers' generate() and to the native implementation, with chunked
prefill, batching, prefix-cache hits and preemption; an architecture with no native code falls back to
it under ``auto``; what it cannot run is refused at load with the reason."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch
from engine_helpers import hf_greedy
from model_factory import _randomize, make_checkpoint, make_tokenizer

BLOCK = 16
NEW_TOKENS = 12


def make_hf_checkpoint(tmp_dir, config_name: str, arch: str, **overrides) -> str:
    """A tiny random checkpoint of any transformers decoder (``config_name``, e.g. ``"Olmo2Config"``) and
    the test tokenizer, in the layout ``model_factory.make_checkpoint`` writes."""
    import transformers
    from transformers import GenerationConfig

    kwargs = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    config = getattr(transformers, config_name)(**(kwargs | overrides))
    config.architectures = [arch]
    path = os.fspath(tmp_dir)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).to(torch.float32)
    _randomize(model, config.hidden_size, 0)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(config.vocab_size).save_pretrained(path)
    return path


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 13, BLOCK, 3 * BLOCK + 5, 41, 7)]
    shared = prompts[3][:2 * BLOCK + 3]  # (two full blocks: cached by the first request that has them)
    return prompts + [shared + [rng.randrange(3, 500) for _ in range(n)] for n in (1, 9)]


def _generate(path: str, prompts: list[list[int]], **kwargs) -> tuple[list[list[int]], object]:
    from halserve import LLM, SamplingParams

    llm = LLM(path, platform="cpu", dtype="float32", block_size=BLOCK, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    runs = []
    for _ in range(2):  # the second pass starts from the first's cached blocks
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outputs])
    assert runs[0] == runs[1], "the prefix-cached second pass differs from the first"
    return runs[0], llm


# chunked prefill (16-token budget) with prefix hits; a tiny cache that forces preemption
VARIANTS = {"chunked": dict(max_num_batched_tokens=BLOCK), "preempt": dict(num_kv_blocks=10, max_num_batched_tokens=64)}


@pytest.mark.parametrize(("arch", "variant"), [
    ("llama", "chunked"),
    pytest.param("llama", "preempt", marks=pytest.mark.slow),  # (slow: the default suite keeps one case)
    pytest.param("qwen2", "chunked", marks=pytest.mark.slow),
    pytest.param("qwen2", "preempt", marks=pytest.mark.slow),
])
def test_native_architecture_through_transformers_matches_native_and_hf(tmp_path, arch, variant):
    path = make_checkpoint(tmp_path / arch, arch, tie_word_embeddings=arch == "qwen2")
    prompts = _prompts()
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    got, llm = _generate(path, prompts, model_impl="transformers", **VARIANTS[variant])
    info = llm.llm_engine.model_info
    assert info.model_impl == "transformers"
    assert got == expected
    native, native_llm = _generate(path, prompts, model_impl="halserve", **VARIANTS[variant])
    assert native_llm.llm_engine.model_info.model_impl == "halserve"
    assert native == got
    stats = llm.llm_engine.get_stats()
    if variant == "preempt":
        assert stats.num_preemptions > 0, "the tiny cache should have forced preemption"
    else:
        assert stats.prefix_cache_hits > 0, "the shared prefix should have been served from the cache"


def test_sharded_tied_checkpoint_loads(tmp_path):
    path = make_checkpoint(tmp_path / "m", "llama", tie_word_embeddings=True, max_shard_size="40KB")
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    prompts = _prompts()[:3]
    got, llm = _generate(path, prompts, model_impl="transformers")
    assert got == hf_greedy(path, prompts, NEW_TOKENS)
    model = llm.llm_engine.core.executor.worker.model_runner.model  # (the uni executor: in this process)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # one rank: transformers' nn.Linear layers run as halserve's (the platform's GEMM kernel)
    from halserve.layers.linear import ColumnParallelLinear

    attn = model.model.layers[0].self_attn
    assert all(isinstance(m, ColumnParallelLinear) for m in (attn.q_proj, attn.o_proj, model.model.layers[0].mlp.up_proj))


# architectures with no native code in halserve, served by auto's fallback: (config class, architecture,
# overrides that make each exercise its own code). A sliding layer then a full one with a 24-token window,
# shorter than the longest requests (53 + 12 tokens): two KV-cache groups, the window's blocks released.
HYBRID = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=24)
FALLBACK = {
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    # attention/embedding/residual multipliers and a logits divisor (its head's own arithmetic)
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(attention_multiplier=0.2, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0)),
    # a NoPE layer (no rotary) after a sliding rotary one
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layers=[1, 0], use_sliding_window=True, **HYBRID)),
    # every module keeps the config's window; is_sliding says which slide (the full layer is NoPE)
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", HYBRID),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(head_dim=16, use_bias=True)),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(head_dim=16, attention_bias=True)),
    # LayerNorm, parallel attention + MLP, a logit scale on the head
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(logit_scale=0.5, **HYBRID)),
    "helium": ("HeliumConfig", "HeliumForCausalLM", dict(head_dim=16)),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", HYBRID),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", {}),  # ReLU-squared MLP without a gate
}
DEFAULT_FALLBACK = ("olmo2", "exaone4")  # (the rest are slow: the default suite keeps a full and a hybrid one)


@pytest.fixture(scope="module")
def fallback_models(tmp_path_factory):
    """``get(name) -> (path, transformers' greedy tokens for _prompts())``: one tiny checkpoint per
    architecture ("llama" or a FALLBACK name) and its reference, made once and shared by the tests here."""
    made: dict[str, tuple[str, list[list[int]]]] = {}

    def get(name: str) -> tuple[str, list[list[int]]]:
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            if name == "llama":
                path = make_checkpoint(folder, "llama")
            else:
                config_name, arch, overrides = FALLBACK[name]
                path = make_hf_checkpoint(folder, config_name, arch, **overrides)
            made[name] = (path, hf_greedy(path, _prompts(), NEW_TOKENS))
        return made[name]

    return get


@pytest.mark.parametrize("name", [n if n in DEFAULT_FALLBACK else pytest.param(n, marks=pytest.mark.slow)
                                  for n in FALLBACK])
def test_architecture_without_native_code_falls_back_to_transformers(fallback_models, name, caplog):
    """One engine per architecture: 16-token chunks, a 10-block cache that forces preemption, and a second
    pass served from the first's cached prefixes, all token-identical to transformers' generate()."""
    from halserve.models import supported_architectures
    from halserve.models.kv_cache_specs import model_kv_cache_specs

    config_name, arch, overrides = FALLBACK[name]
    assert arch not in supported_architectures(), f"{arch} became native: pick another fallback architecture"
    path, expected = fallback_models(name)
    prompts = _prompts()
    with caplog.at_level("WARNING", logger="halserve.models.loader"):
        got, llm = _generate(path, prompts, max_num_batched_tokens=BLOCK, num_kv_blocks=10)  # model_impl "auto"
    info = llm.llm_engine.model_info
    assert info.model_impl == "transformers"
    assert any("no native halserve implementation" in r.getMessage() for r in caplog.records)
    assert got == expected
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0, "the 10-block cache should have forced preemption"
    assert stats.prefix_cache_hits > 0, "the second pass should have been served from cached prefixes"
    windows = [getattr(spec, "window", None) for spec in model_kv_cache_specs(info)]
    assert windows == ([24, None] if "layer_types" in overrides else []), "the KV cache's layer specs"


def _tp_layout(worker) -> dict:
    """(run on each rank by collective_rpc) what its model holds: local heads per attention layer and
    the kind and shape of layer 0's q projection and MLP down projection."""
    model = worker.model_runner.model
    layer = model.model.layers[0]
    q, down = layer.self_attn.q_proj, layer.mlp.down_proj
    return {"heads": [(a.num_heads, a.num_kv_heads) for a in model.attention_layers],  # ([out, in] this rank holds)
            "q_proj": (type(q).__name__, (q.output_size_per_partition, q.input_size_per_partition)),
            "down_proj": (type(down).__name__, (down.output_size_per_partition, down.input_size_per_partition))}


# two ranks from each model's base_model_tp_plan: Llama's colwise/rowwise (heads split), OLMo 2/3's
# colwise_gather_output/rowwise_split_input (q/k/v gathered for their full-width q/k norms: every rank
# attends over all heads), GLM-4's gathered gate_up_proj, EXAONE 4's replicated q/k norms, sliding layers
# (SmolLM3, EXAONE 4, Cohere 2, OLMo 3), biases added once after the all-reduce (ERNIE 4.5, GLM-4),
# Cohere 2's parallel attention + MLP and Granite's multipliers
TP_GATHERED = ("olmo2", "olmo3")  # -> 4 heads / 2 KV heads per rank; the rest: 2 / 1


@pytest.mark.slow  # (two spawned ranks per case: ~5 s each, ~11 s on a busy 2-core machine)
@pytest.mark.parametrize("name", ["llama", *FALLBACK])
def test_two_tensor_parallel_ranks_match_transformers(fallback_models, name):
    """TP=2 against transformers' generate() (one rank is checked against it above), with 16-token chunks,
    preemption and prefix-cache hits; both ranks hold the layout their base_model_tp_plan gives."""
    path, expected = fallback_models(name)
    impl = "transformers" if name == "llama" else "auto"
    two, llm = _generate(path, _prompts(), model_impl=impl, max_num_batched_tokens=BLOCK, num_kv_blocks=10,
                         tensor_parallel_size=2)
    try:
        assert llm.llm_engine.model_info.model_impl == "transformers"
        stats = llm.llm_engine.get_stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        layouts = llm.collective_rpc(_tp_layout)
    finally:
        llm.llm_engine.shutdown()
    assert two == expected
    assert len(layouts) == 2 and layouts[0] == layouts[1]
    assert layouts[0]["heads"] == [(4, 2) if name in TP_GATHERED else (2, 1)] * 2
    assert layouts[0]["q_proj"] == ("_HFColumnParallelLinear", (32, 64))  # half of [64, 64] on each rank
    assert layouts[0]["down_proj"] == ("_HFRowParallelLinear", (64, 64))  # half of [64, 128]


@pytest.mark.slow  # (two spawned stages per case: ~5 s each, ~10 s on a busy 2-core machine)
@pytest.mark.parametrize("name", ["olmo2", "granite"])
def test_two_pipeline_stages_match_transformers(fallback_models, name):
    """PP=2 (one layer per stage) against transformers' generate(), with 16-token chunks, preemption and
    prefix hits: OLMo 2, and Granite (its embedding multiplier applied once, on the first stage). (A model
    with sliding and full layers is refused under PP by the model runner: a hybrid KV cache over stages
    is not supported yet, native or not.)"""
    path, expected = fallback_models(name)
    got, llm = _generate(path, _prompts(), max_num_batched_tokens=BLOCK, num_kv_blocks=10, pipeline_parallel_size=2)
    try:
        assert llm.llm_engine.model_info.model_impl == "transformers"
        stats = llm.llm_engine.get_stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        stages = llm.collective_rpc(_pp_stage)
    finally:
        llm.llm_engine.shutdown()
    assert got == expected
    assert stages == [((0, 1), "_PPPassThrough", True, False), ((1, 2), "_PPStageInput", False, True)]


def _pp_stage(worker) -> tuple:
    """(run on each stage) its layers [start, end), what stands for its other layer, whether it embeds
    tokens and holds the LM head."""
    from halserve.layers import ParallelLMHead, VocabParallelEmbedding

    model = worker.model_runner.model
    other = model.model.layers[1 if model.start_layer == 0 else 0]
    return ((model.start_layer, model.end_layer), type(other).__name__,
            isinstance(model.model.embed_tokens, VocabParallelEmbedding), isinstance(model.lm_head, ParallelLMHead))


def test_fallback_refused_with_model_impl_halserve(tmp_path):
    from halserve import LLM

    path = make_hf_checkpoint(tmp_path / "olmo2", "Olmo2Config", "Olmo2ForCausalLM", num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"Olmo2ForCausalLM.*not supported.*--model-impl transformers"):
        LLM(path, platform="cpu", dtype="float32", model_impl="halserve")


def _config_only(tmp_path, config_name: str, arch: str, **overrides) -> str:
    """A checkpoint folder holding only config.json: refusals come before any weight is read."""
    import transformers

    config = getattr(transformers, config_name)(**overrides)
    config.architectures = [arch]
    path = os.fspath(tmp_path)
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    return path


@pytest.mark.parametrize("model_impl", ["auto", "transformers"])
@pytest.mark.parametrize(("config_name", "arch", "overrides", "reason"), [
    ("MambaConfig", "MambaForCausalLM", dict(hidden_size=64, num_hidden_layers=2, vocab_size=512),
     "AttentionInterface|recurrent"),
    ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(hidden_size=64, num_hidden_layers=4, vocab_size=512),
     r"layer types \['linear_attention'\]"),
    # a plain decoder whose attention module calls its own code, not transformers' AttentionInterface
    ("StableLmConfig", "StableLmForCausalLM", dict(hidden_size=64, num_hidden_layers=2, vocab_size=512,
                                                   num_attention_heads=4, num_key_value_heads=2),
     r"StableLmForCausalLM\) does not route attention through transformers' AttentionInterface"),
])
def test_unsupported_model_is_refused_with_the_reason(tmp_path, config_name, arch, overrides, reason, model_impl):
    from halserve.config import EngineConfig
    from halserve.models.loader import get_model_info
    from halserve.platforms import resolve_platform

    path = _config_only(tmp_path / arch, config_name, arch, **overrides)
    config = EngineConfig(model=path, platform="cpu", dtype="float32", model_impl=model_impl)
    with pytest.raises(ValueError, match=rf"{arch} cannot run on the Transformers modeling backend.*({reason})"):
        get_model_info(config, resolve_platform("cpu"))


def test_refuses_a_config_without_a_parallel_layout(tmp_path):
    from halserve.config import EngineConfig
    from halserve.models.loader import get_model_info
    from halserve.platforms import resolve_platform

    path = _config_only(tmp_path / "olmo2", "Olmo2Config", "Olmo2ForCausalLM", hidden_size=64, num_attention_heads=4,
                        num_key_value_heads=2, num_hidden_layers=2, vocab_size=512, intermediate_size=128)
    # a config without a pipeline layout (base_model_pp_plan), and a tensor-parallel plan entry with no halserve
    # layer, are named
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    raw["base_model_pp_plan"] = None
    raw["base_model_tp_plan"] = {"layers.*.self_attn.q_proj": "colwise", "layers.*.mlp.experts": "grouped_gemm"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    config = EngineConfig(model=path, platform="cpu", dtype="float32", pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="its config has no base_model_pp_plan .* for pipeline_parallel_size=2"):
        get_model_info(config, resolve_platform("cpu"))
    config = EngineConfig(model=path, platform="cpu", dtype="float32", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"base_model_tp_plan entry 'layers.\*.mlp.experts': 'grouped_gemm' has no "
                                         "halserve parallel layer"):
        get_model_info(config, resolve_platform("cpu"))


def test_model_impl_is_validated():
    from pydantic import ValidationError

    from halserve.config import EngineConfig

    with pytest.raises(ValidationError, match="model_impl 'vllm' is not supported; use one of auto, halserve"):
        EngineConfig(model="x", model_impl="vllm")


@pytest.mark.parametrize("impl", ["halserve", "transformers"])
def test_models_endpoint_and_plugins_say_which_implementation(impl):
    from types import SimpleNamespace

    from halserve.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
    from halserve.models.transformers_backend import backend_status

    serving = SimpleNamespace(served_model_names=["m"], created=0, model_path="/m", max_model_len=64,
                              engine=SimpleNamespace(model_info=SimpleNamespace(model_impl=impl)), lora_modules={})
    listed = json.loads(OpenAIServingTokenization(serving).models().model_dump_json())
    assert listed["data"][0]["model_impl"] == impl
    status = backend_status()
    assert status["available"] and status["transformers_version"]

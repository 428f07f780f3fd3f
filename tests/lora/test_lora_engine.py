"""Multi-LoRA through the offline API: an adapter gives what its merged checkpoint gives
(halserve and transformers), in mixed batches, without prefix-cache leaks, with bad adapters
refused while the engine keeps serving."""
from __future__ import annotations

import json
import os
import shutil

import pytest
from engine_helpers import hf_greedy
from lora_factory import ENGINE_KWARGS, NEW_TOKENS, sampled_logprobs
from lora_factory import greedy as _greedy
from lora_factory import prompt_dicts as _prompts
from lora_factory import token_ids as _tokens

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')


@pytest.fixture(scope="module")
def lora_llm(lora_models):
    from halserve import LLM

    llm = LLM(lora_models.base, enable_lora=True, max_loras=2, max_lora_rank=16, **ENGINE_KWARGS)
    yield llm
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("which", [1, 2])
def test_lora_equals_merged_checkpoint_and_transformers(which, lora_llm, loras, lora_models, merged_outputs):
    outs = lora_llm.generate(_prompts(lora_models.prompts), _greedy(logprobs=0), use_tqdm=False,
                             lora_request=loras[which - 1])
    tokens = _tokens(outs)
    merged_tokens, merged_logprobs = merged_outputs[f"merged{which}"]
    assert tokens == merged_tokens
    assert tokens != merged_outputs["base"][0]  # the adapter matters
    for out, expected in zip(outs, merged_logprobs):
        assert sampled_logprobs(out) == pytest.approx(expected, abs=1e-4)
    merged_path = getattr(lora_models, f"merged{which}")
    assert tokens == hf_greedy(merged_path, lora_models.prompts, NEW_TOKENS)


def test_lora_equals_peft(lora_llm, loras, lora_models):
    peft = pytest.importorskip("peft")
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(lora_models.base, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model = peft.PeftModel.from_pretrained(model, lora_models.a2).eval()
    expected = []
    with torch.inference_mode():
        for ids in lora_models.prompts[:2]:
            x = torch.tensor([ids])
            y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                               do_sample=False, pad_token_id=0)
            expected.append(y[0, len(ids):].tolist())
    outs = lora_llm.generate(_prompts(lora_models.prompts[:2]), _greedy(), use_tqdm=False, lora_request=loras[1])
    assert _tokens(outs) == expected


def test_mixed_batch_gives_each_request_its_own_adapter(lora_llm, loras, lora_models, merged_outputs):
    a1, a2 = loras
    prompts = lora_models.prompts
    choice = [a1, None, a2, a1, a2, None, None, a1]  # both adapters and the base in every step
    batch = [prompts[i % len(prompts)] for i in range(len(choice))]
    outs = lora_llm.generate(_prompts(batch), _greedy(), use_tqdm=False, lora_request=choice)
    reference = {None: merged_outputs["base"][0], a1: merged_outputs["merged1"][0], a2: merged_outputs["merged2"][0]}
    assert _tokens(outs) == [reference[lora][i % len(prompts)] for i, lora in enumerate(choice)]


def test_prefix_cache_is_not_shared_across_adapters(lora_llm, loras, lora_models, merged_outputs):
    a1, a2 = loras
    prompt = lora_models.prompts[2]  # 40 tokens: two full blocks
    expected = {None: merged_outputs["base"][0][2], a1: merged_outputs["merged1"][0][2],
                a2: merged_outputs["merged2"][0][2]}
    lora_llm.llm_engine.core.scheduler.reset_prefix_cache()
    for lora in (None, a1, a2):  # the same prompt, each after the others cached it
        (out,) = lora_llm.generate(_prompts([prompt]), _greedy(), use_tqdm=False, lora_request=lora)
        assert out.outputs[0].token_ids == expected[lora]
        assert out.num_cached_tokens == 0
    (again,) = lora_llm.generate(_prompts([prompt]), _greedy(), use_tqdm=False, lora_request=a2)
    assert again.outputs[0].token_ids == expected[a2]
    assert again.num_cached_tokens == 32  # the same adapter does share its blocks


def test_chat_with_lora(lora_llm, loras, lora_models):
    from halserve import LLM

    messages = [{"role": "user", "content": "tell me about the quick brown fox"}]
    got = lora_llm.chat(messages, _greedy(), use_tqdm=False, lora_request=loras[0])
    merged = LLM(lora_models.merged1, **ENGINE_KWARGS)
    try:
        expected = merged.chat(messages, _greedy(), use_tqdm=False)
    finally:
        merged.llm_engine.shutdown()
    assert _tokens(got) == _tokens(expected)


def test_max_loras_one_runs_two_adapters_to_completion(lora_models, loras, merged_outputs):
    """One adapter per step and one kept loaded: the other waits, and is read again from disk."""
    from halserve import LLM

    a1, a2 = loras
    llm = LLM(lora_models.base, enable_lora=True, max_loras=1, max_cpu_loras=1, **ENGINE_KWARGS)
    try:
        choice = [a1, a2, a1, None, a2]
        batch = [lora_models.prompts[i % 4] for i in range(len(choice))]
        outs = llm.generate(_prompts(batch), _greedy(), use_tqdm=False, lora_request=choice)
        reference = {None: "base", a1: "merged1", a2: "merged2"}
        assert _tokens(outs) == [merged_outputs[reference[lora]][0][i % 4] for i, lora in enumerate(choice)]
    finally:
        llm.llm_engine.shutdown()


# -- bad adapters ------------------------------------------------------------------------
def _bad_adapter(tmp_path, base, kind):
    from lora_factory import make_adapter
    from model_factory import make_checkpoint

    path = tmp_path / kind
    if kind == "rank_too_high":
        return make_adapter(path, base, r=32), "r=32 exceeds max_lora_rank=16"
    if kind == "targets_lm_head":
        return make_adapter(path, base, config_overrides={"target_modules": ["q_proj", "lm_head"]}), "'lm_head'"
    if kind == "other_model":
        other = make_checkpoint(tmp_path / "other_base", "llama", hidden_size=32, num_layers=2)
        return make_adapter(path, base, shapes_from=other), "trained for a different base model"
    if kind == "dora":
        return make_adapter(path, base, config_overrides={"use_dora": True}), "DoRA"
    if kind == "bias":
        return make_adapter(path, base, config_overrides={"bias": "all"}), "bias='all' is not supported"
    if kind == "modules_to_save":
        return make_adapter(path, base, config_overrides={"modules_to_save": ["lm_head"]}), "modules_to_save"
    if kind == "missing_layer":
        from safetensors.torch import load_file, save_file

        made = make_adapter(path, base)
        weights = load_file(os.path.join(made, "adapter_model.safetensors"))
        key = "base_model.model.model.layers.0.self_attn.q_proj"
        for ab in ("lora_A", "lora_B"):
            weights[f"{key.replace('layers.0', 'layers.7')}.{ab}.weight"] = weights[f"{key}.{ab}.weight"].clone()
        save_file(weights, os.path.join(made, "adapter_model.safetensors"))
        return made, "model.layers.7.self_attn.q_proj"
    if kind == "no_weights":
        made = make_adapter(path, base)
        os.remove(os.path.join(made, "adapter_model.safetensors"))
        return made, "no adapter weights"
    if kind == "no_config":
        made = make_adapter(path, base)
        os.remove(os.path.join(made, "adapter_config.json"))
        return made, "adapter_config.json"
    if kind == "not_a_dir":
        return str(tmp_path / "does" / "not" / "exist"), "not a directory"
    if kind == "alpha_nan":  # (Python's json reads NaN)
        return make_adapter(path, base, config_overrides={"lora_alpha": float("nan")}), "lora_alpha must be a finite"
    if kind == "rslora_string":  # ("false" is truthy: it used to turn rslora on)
        return make_adapter(path, base, config_overrides={"use_rslora": "false"}), "use_rslora must be true or false"
    raise AssertionError(kind)


BAD_KINDS = ["rank_too_high", "targets_lm_head", "other_model", "dora", "bias", "modules_to_save", "missing_layer",
             "no_weights", "no_config", "not_a_dir", "alpha_nan", "rslora_string"]


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_adapter_fails_its_request_and_the_engine_keeps_serving(kind, tmp_path, lora_llm, loras, lora_models,
                                                                    merged_outputs):
    from halserve import LoRARequest

    path, why = _bad_adapter(tmp_path, lora_models.base, kind)
    bad = LoRARequest(f"bad-{kind}", 100 + BAD_KINDS.index(kind), path)
    good_prompt = lora_models.prompts[0]
    with pytest.raises(ValueError) as info:  # alone, and beside a good request
        lora_llm.generate(_prompts([good_prompt, good_prompt]), _greedy(), use_tqdm=False,
                          lora_request=[loras[0], bad])
    message = str(info.value)
    assert f"bad-{kind}" in message and why in message, message
    assert not lora_llm.llm_engine.has_unfinished_requests()
    outs = lora_llm.generate(_prompts([good_prompt]), _greedy(), use_tqdm=False, lora_request=loras[0])
    assert _tokens(outs) == [merged_outputs["merged1"][0][0]]


def test_adapter_rank_mismatch_between_config_and_weights(tmp_path, lora_llm, lora_models):
    from lora_factory import make_adapter

    from halserve import LoRARequest

    path = make_adapter(tmp_path / "r", lora_models.base, r=4)
    with open(os.path.join(path, "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg["r"] = 8
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="do not have rank r=8"):
        lora_llm.llm_engine.add_lora(LoRARequest("mismatch", 200, path))


def test_lora_request_needs_enable_lora(lora_models, loras):
    from halserve import LLM

    llm = LLM(lora_models.base, **ENGINE_KWARGS)
    try:
        with pytest.raises(ValueError, match="enable_lora=True"):
            llm.generate(_prompts(lora_models.prompts[:1]), _greedy(), use_tqdm=False, lora_request=loras[0])
        assert len(llm.generate(_prompts(lora_models.prompts[:1]), _greedy(), use_tqdm=False)) == 1
    finally:
        llm.llm_engine.shutdown()


def test_lora_int_id_must_be_unique_per_adapter(tmp_path, lora_llm, loras, lora_models):
    from halserve import LoRARequest

    copy = shutil.copytree(lora_models.a2, tmp_path / "a2_copy")
    lora_llm.llm_engine.add_lora(loras[0])
    with pytest.raises(ValueError, match="lora_int_id 1 is already used by adapter 'a1'"):
        lora_llm.generate(_prompts(lora_models.prompts[:1]), _greedy(), use_tqdm=False,
                          lora_request=LoRARequest("other", 1, str(copy)))
    with pytest.raises(ValueError, match="lora_int_id must be a positive int"):
        LoRARequest("zero", 0, str(copy))
    with pytest.raises(ValueError, match="2 prompts but 3 lora requests"):
        lora_llm.generate(_prompts(lora_models.prompts[:2]), _greedy(), use_tqdm=False, lora_request=[None] * 3)


def test_remove_lora(lora_llm, loras, lora_models, merged_outputs):
    engine = lora_llm.llm_engine
    engine.add_lora(loras[1])
    assert 2 in engine.list_loras()
    assert engine.remove_lora(2)
    assert 2 not in engine.list_loras()
    assert not engine.remove_lora(2)
    outs = lora_llm.generate(_prompts(lora_models.prompts[:1]), _greedy(), use_tqdm=False, lora_request=loras[1])
    assert _tokens(outs) == [merged_outputs["merged2"][0][0]]  # loaded again on use


def test_async_llm_takes_a_lora_request_per_request(lora_models, loras, merged_outputs):
    import asyncio

    from halserve.config import EngineConfig
    from halserve.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_config(EngineConfig(model=lora_models.base, enable_lora=True, max_loras=2,
                                               **ENGINE_KWARGS))

    async def run() -> list[list[int]]:
        async def one(i: int, lora) -> list[int]:
            final = None
            async for final in engine.generate({"prompt_token_ids": lora_models.prompts[i]}, _greedy(),  # noqa: B007
                                               request_id=f"r{i}", lora_request=lora):
                pass
            return final.outputs[0].token_ids

        try:
            tokens = await asyncio.gather(one(0, loras[0]), one(1, None), one(2, loras[1]))
            assert await engine.list_loras() == {1, 2}
            return tokens
        finally:
            await engine.shutdown()

    expected = [merged_outputs["merged1"][0][0], merged_outputs["base"][0][1], merged_outputs["merged2"][0][2]]
    assert asyncio.run(run()) == expected


def test_beam_search_with_an_adapter(lora_llm, loras, lora_models, merged_outputs):
    from halserve import BeamSearchParams

    params = BeamSearchParams(beam_width=1, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = lora_llm.beam_search(_prompts(lora_models.prompts[:2]), params, lora_request=loras[0])
    generated = [out.sequences[0].tokens[len(out.prompt_token_ids):] for out in outs]
    assert generated == merged_outputs["merged1"][0][:2]  # width 1 is greedy, with the adapter

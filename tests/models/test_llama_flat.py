"""The Llama family's flat forward (models/llama_flat.py) against the module path: the same greedy tokens and
bit-identical log-probs, for float32 checkpoints and GGUF blocks, one stream and several (mixed prefill and
decode steps, chunked prefill), and the module path wherever the flat forward says it does not apply. GGUF
models' decode steps run the C++ decode plan (decode_plan.cpp): bit-identical to the flat loop in Python and to
the module path, remade when a weight is written."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from halserve.models.llama_flat import FLAT_FORWARD_ENV, LlamaFlatForward


def _greedy(path: str, prompts: list[list[int]], flat: bool | str, max_tokens: int = 12,
            fused_calls: list | None = None, plan_steps: list | None = None, **kwargs):
    """(token ids per prompt, logprob of each chosen token per prompt, what the model ran: the flat forward or
    the module path's reason). ``flat``: True (the flat forward, its C++ decode plan where it applies), "python"
    (the flat loop in Python on every step) or False (the module path). ``fused_calls`` gets one entry per call
    of the cpu kernels' fused decode attention (``rotary_write_decode``) from Python; ``plan_steps`` one per decode
    step the C++ plan ran (its own attention calls are C++'s)."""
    from halserve import LLM, SamplingParams
    from halserve.platforms import cpu_kernels

    kernel = cpu_kernels.load()
    fused = kernel.rotary_write_decode

    def counted(*args):
        if fused_calls is not None:
            fused_calls.append(args[0].shape[0])
        return fused(*args)

    run_plan = LlamaFlatForward._run_plan

    def counted_plan(self, hidden, *args):
        out = run_plan(self, hidden, *args)
        if out is not None and plan_steps is not None:
            plan_steps.append(hidden.shape[0])
        return out

    os.environ[FLAT_FORWARD_ENV] = flat if isinstance(flat, str) else "1" if flat else "0"  # (read at the first step)
    kernel.rotary_write_decode = counted
    LlamaFlatForward._run_plan = counted_plan
    llm = LLM(path, platform="cpu", dtype="float32", block_size=16, max_num_batched_tokens=32, max_model_len=256,
              **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        model = llm.llm_engine.core.executor.worker.model_runner.model
        ran = model._flat
    finally:
        os.environ.pop(FLAT_FORWARD_ENV, None)
        kernel.rotary_write_decode = fused
        LlamaFlatForward._run_plan = run_plan
        llm.llm_engine.shutdown()
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[step[tok].logprob for step, tok in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                for o in outs]
    return tokens, logprobs, ran


# (ids < 300: the tiny GGUF's vocabulary is 308) one stream; several: a 1-token prompt, one over the 32-token step budget (chunked), others between
PROMPTS = {"1 stream": [[5, 17, 99, 3]],
           "4 streams": [[7], [i * 37 % 290 + 3 for i in range(45)], [11, 12, 13, 14, 15, 16, 17], [42] * 20]}


def _assert_same(path: str, prompts: list[list[int]], fused: bool = False, plan: bool = False, **kwargs) -> None:
    """``fused``: the flat forward's decode steps must have taken the one-call attention (float32 on cpu_native,
    no q/k norms), which the module path never calls. ``plan``: its decode steps ran the C++ decode plan (GGUF
    on the native kernel), and the flat loop in Python (``HALSERVE_FLAT_FORWARD=python``) gives the same."""
    fused_calls: list[int] = []
    plan_steps: list[int] = []
    flat_tokens, flat_logprobs, ran = _greedy(path, prompts, True, fused_calls=fused_calls, plan_steps=plan_steps,
                                              **kwargs)
    assert isinstance(ran, LlamaFlatForward), ran
    assert bool(plan_steps) == plan, plan_steps
    if plan:
        assert max(plan_steps) == len(prompts)  # (its steps with every stream decoding)
        python_calls: list[int] = []
        python_tokens, python_logprobs, ran = _greedy(path, prompts, "python", fused_calls=python_calls,
                                                      plan_steps=plan_steps, **kwargs)
        assert isinstance(ran, LlamaFlatForward) and ran._plan is False, ran
        # one-call attentions from Python now, one a layer on each step the plan ran before
        assert len(python_calls) == len(plan_steps) * len(ran.layers)
        assert (python_tokens, python_logprobs) == (flat_tokens, flat_logprobs)
    else:
        assert bool(fused_calls) == fused, fused_calls
    flat_calls = len(fused_calls)
    module_tokens, module_logprobs, ran_off = _greedy(path, prompts, False, fused_calls=fused_calls, **kwargs)
    assert len(fused_calls) == flat_calls  # (the module path makes none)
    assert ran_off == f"{FLAT_FORWARD_ENV}=0"
    assert flat_tokens == module_tokens
    assert flat_logprobs == module_logprobs  # bit-identical floats: the same kernels in the same order


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    from model_factory import make_checkpoint

    return make_checkpoint(str(tmp_path_factory.mktemp("flat")), "llama", vocab_size=512, num_layers=2)


@pytest.mark.parametrize("streams", list(PROMPTS))
def test_float32_checkpoint_flat_equals_module_path(llama_checkpoint, streams):
    _assert_same(llama_checkpoint, PROMPTS[streams], fused=True)


@pytest.mark.parametrize("cache", ["bfloat16", "float16"])
def test_a_16_bit_kv_cache_takes_the_one_call_attention(llama_checkpoint, cache):
    """kv_cache_dtype="bfloat16" / "float16" under float32: the fused decode attention takes the 16-bit cache,
    and gives the module path's (cpu_native forward's write_kv + paged_decode) tokens and log-probs bit for bit."""
    _assert_same(llama_checkpoint, PROMPTS["4 streams"], fused=True, kv_cache_dtype=cache)


def test_torch_attention_backend_goes_through_backend_forward(llama_checkpoint):
    _assert_same(llama_checkpoint, PROMPTS["4 streams"], attention_backend="torch")


def test_qwen3_qk_norm(tmp_path):
    from model_factory import make_checkpoint

    path = make_checkpoint(str(tmp_path), "qwen3", vocab_size=512, num_layers=2, head_dim=32)
    _assert_same(path, PROMPTS["4 streams"], max_tokens=8)


def _gguf_helpers():
    pytest.importorskip("gguf", reason="the GGUF tests need the gguf package")
    spec = importlib.util.spec_from_file_location("gguf_loading_helpers",
                                                  os.path.join(os.path.dirname(__file__), "test_gguf_loading.py"))
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    return helpers


@pytest.mark.parametrize("streams", list(PROMPTS))
def test_gguf_blocks_flat_equals_module_path(tmp_path, streams):
    helpers = _gguf_helpers()
    path = helpers.write_gguf(str(tmp_path / "q41.gguf"), "llama", qtype=helpers.T.Q4_1)
    _assert_same(path, PROMPTS[streams], fused=True, plan=True)


@pytest.mark.parametrize("cache", ["float32", "float16"])
def test_gguf_decode_plan_with_biases(tmp_path, cache):
    """Qwen2's q/k/v biases (added after the GEMM, as the bound call does), Q8_0 blocks, both cache types."""
    helpers = _gguf_helpers()
    path = helpers.write_gguf(str(tmp_path / "qwen2.gguf"), "qwen2", qtype=helpers.T.Q8_0)
    _assert_same(path, PROMPTS["4 streams"], plan=True, kv_cache_dtype=cache)


def test_gguf_decode_plan_is_remade_when_a_weight_is_written(tmp_path):
    """A GGUF weight written in place after the plan was made (a reload): the plan's run says so, the weight is
    repacked and the plan made again, and the answers are the flat loop's on the new weight."""
    from halserve import LLM, SamplingParams

    helpers = _gguf_helpers()
    path = helpers.write_gguf(str(tmp_path / "q80.gguf"), "llama", qtype=helpers.T.Q8_0)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    results = {}
    for mode in ("1", "python"):
        os.environ[FLAT_FORWARD_ENV] = mode
        llm = LLM(path, platform="cpu", dtype="float32", max_model_len=256)
        try:
            before = llm.generate([{"prompt_token_ids": [5, 17, 99, 3]}], params, use_tqdm=False)[0].outputs[0]
            model = llm.llm_engine.core.executor.worker.model_runner.model
            plan = model._flat._plan
            qweight = model.model.layers[0].mlp.down_proj.gguf_runs[0][1]
            rows = qweight.shape[0]
            qweight[: rows // 2].copy_(qweight[rows // 2:].clone())  # (in place: its version moves)
            after = llm.generate([{"prompt_token_ids": [5, 17, 99, 3]}], params, use_tqdm=False)[0].outputs[0]
            remade = model._flat._plan
        finally:
            os.environ.pop(FLAT_FORWARD_ENV, None)
            llm.llm_engine.shutdown()
        if mode == "1":
            assert plan is not False and plan is not None and remade is not plan
        else:
            assert plan is False and remade is False
        results[mode] = [(o.token_ids, [step[t].logprob for step, t in zip(o.logprobs, o.token_ids)])
                         for o in (before, after)]
    assert results["1"] == results["python"]
    assert results["1"][0][1] != results["1"][1][1]  # (the written weight did change the answer's numbers)


# -- where it does not apply ------------------------------------------------------------------------
def _model(path: str, **kwargs):
    from halserve.attention_backends.cpu_native import CpuNativeAttentionBackend
    from halserve.config import EngineConfig
    from halserve.models.loader import get_model_info, load_model
    from halserve.platforms.cpu import CpuPlatform

    config = EngineConfig(model=path, dtype="float32", **kwargs)
    platform = CpuPlatform()
    return load_model(config, get_model_info(config, platform), platform, CpuNativeAttentionBackend, progress=False)


def test_why_not_names_each_fallback(llama_checkpoint, monkeypatch):
    model = _model(llama_checkpoint)
    assert LlamaFlatForward.why_not(model, "cpu") is None
    assert "platform 'cuda'" in LlamaFlatForward.why_not(model, "cuda")
    monkeypatch.setenv(FLAT_FORWARD_ENV, "0")
    assert LlamaFlatForward.why_not(model, "cpu") == f"{FLAT_FORWARD_ENV}=0"
    monkeypatch.delenv(FLAT_FORWARD_ENV)
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *args: None)
    assert "forward hook on LlamaMLP" in LlamaFlatForward.why_not(model, "cpu")
    handle.remove()
    model.model.layers[0].self_attn.attn.kv_cache_group = 1
    assert "KV-cache groups" in LlamaFlatForward.why_not(model, "cpu")
    model.model.layers[0].self_attn.attn.kv_cache_group = None
    model.model.layers[0].mlp.down_proj = torch.nn.Identity()  # (what a LoRA wrapper does: another class)
    assert "Identity where RowParallelLinear is expected" in LlamaFlatForward.why_not(model, "cpu")


def test_lora_engine_keeps_the_module_path(llama_checkpoint):
    """With LoRA enabled the linear modules are LoRA wrappers (another class): the module path serves."""
    _, _, ran = _greedy(llama_checkpoint, PROMPTS["1 stream"], True, max_tokens=3, enable_lora=True, max_lora_rank=8)
    assert isinstance(ran, str) and "WithLoRA where" in ran, ran


def test_step_falls_back_when_a_linear_is_replaced_after_build(llama_checkpoint):
    """A bound linear module replaced after the build (LoRA's wrapping, say): the step returns None and the
    model's forward runs the module path, which uses the new module."""
    from halserve.attention_backends.torch_ref import TorchAttentionBackend  # noqa: F401 (backend registry)
    from halserve.forward_context import set_forward_context

    model = _model(llama_checkpoint)
    flat = LlamaFlatForward(model)
    assert flat.is_current()
    mlp = model.model.layers[0].mlp
    original = mlp.down_proj
    calls = []

    class Wrapped(torch.nn.Module):
        def forward(self, x):
            calls.append(x.shape)
            return original(x)

    mlp.down_proj = Wrapped()
    assert not flat.is_current()
    with set_forward_context(object()):  # any metadata: the check comes first
        assert flat(torch.tensor([1, 2]), torch.tensor([0, 1])) is None
    model._flat = flat
    with set_forward_context(None):  # a dummy run: the module path (attention returns zeros), through Wrapped
        hidden = model(torch.tensor([1, 2]), torch.tensor([0, 1]))
    assert hidden.shape == (2, 64) and calls == [(2, 128)]

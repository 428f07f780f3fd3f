"""Sequence classifiers and reward models (``*ForSequenceClassification``) through LLM.classify,
against transformers' logits: softmax over several classes, a sigmoid for one label, raw logits
with activation=False, across batching, chunked prefill and prefix-cache hits, and under tensor
parallelism; requests a model cannot serve are refused, naming what to use."""
from __future__ import annotations

import random

import pytest
import torch
from classifier_factory import classifier_architecture, hf_logits, make_classifier

from halserve import LLM, PoolingParams

MAX_NUM_BATCHED_TOKENS = 32
ENGINE = dict(platform="cpu", dtype="float32", block_size=16, max_model_len=256,
              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [1] + [rng.randrange(3, 512) for _ in range(n - 1)]  # (no pad token 0: transformers would skip it)


def assert_close(got: list[float], want: torch.Tensor) -> None:
    got_t = torch.tensor(got, dtype=torch.float32)
    assert got_t.shape == want.shape, (got_t.shape, want.shape)
    assert (got_t - want).abs().max() < 1e-5 * max(1.0, want.abs().max().item()), (got, want.tolist())


@pytest.mark.parametrize("arch, num_labels", [("qwen2", 3), ("llama", 1), ("mistral", 2), ("qwen3", 4)])
def test_classify_matches_transformers(tmp_path, arch, num_labels):
    """One batch: short prompts, one longer than the step's token budget (chunked prefill), each
    with the model's activation and as raw logits; then a prompt that hits the prefix cache."""
    path = make_classifier(tmp_path, arch, num_labels=num_labels)
    reference = hf_logits(path)
    llm = LLM(path, **ENGINE)
    info = llm.llm_engine.model_info
    assert (info.architecture, info.runner, info.num_labels) == (classifier_architecture(arch), "pooling", num_labels)
    rng = random.Random(num_labels)
    prompts = [random_ids(rng, n) for n in (5, MAX_NUM_BATCHED_TOKENS * 2 + 7, 1, 17)]
    params = [PoolingParams(), PoolingParams(activation=False)]
    outs = llm.classify([{"prompt_token_ids": p} for p in prompts for _ in params], params * len(prompts),
                        use_tqdm=False)
    for i, ids in enumerate(prompts):
        logits = reference(ids)
        # softmax over the classes; one label (a reward model): a sigmoid, which a softmax would make 1
        probs = logits.sigmoid() if num_labels == 1 else logits.softmax(-1)
        activated, raw = outs[2 * i].outputs, outs[2 * i + 1].outputs
        assert activated.num_classes == raw.num_classes == num_labels
        assert_close(activated.probs, probs)
        assert_close(raw.probs, logits)
        assert outs[2 * i].prompt_token_ids == ids
    # a prompt sharing the long one's first blocks starts from the prefix cache, with the same result
    stats = llm.llm_engine.get_stats
    hits = stats().prefix_cache_hits
    shared = prompts[1][:48] + random_ids(rng, 9)[1:]
    (out,) = llm.classify({"prompt_token_ids": shared}, PoolingParams(activation=False), use_tqdm=False)
    assert stats().prefix_cache_hits >= hits + 48
    assert_close(out.outputs.probs, reference(shared))


def test_text_prompts_labels_and_activation_from_the_config(tmp_path):
    """Text prompts are tokenized as transformers' tokenizer does; id2label reaches ModelInfo;
    problem_type picks the activation as transformers' losses do (vLLM's rule)."""
    from transformers import AutoTokenizer

    labels = {0: "negative", 1: "neutral", 2: "positive"}
    path = make_classifier(tmp_path / "multi", "qwen2", num_labels=3, id2label=labels,
                           problem_type="multi_label_classification")
    llm = LLM(path, **ENGINE)
    assert llm.llm_engine.model_info.id2label == labels
    texts = ["hello world, tell me about the quick brown fox", "paris"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    reference = hf_logits(path)
    for text, out in zip(texts, llm.classify(texts, use_tqdm=False)):
        assert_close(out.outputs.probs, reference(tokenizer.encode(text)).sigmoid())  # multi-label: per class

    from halserve.models.sequence_classification import classifier_activation

    config = llm.llm_engine.model_info.hf_config
    for problem_type, num_labels, want in [("regression", 1, "identity"), ("single_label_classification", 3, "softmax"),
                                           (None, 1, "sigmoid"), (None, 2, "softmax")]:
        config.problem_type, config.num_labels = problem_type, num_labels
        assert classifier_activation(config) == want


def test_requests_a_model_cannot_serve_are_refused(tmp_path):
    from model_factory import make_checkpoint

    from halserve.entrypoints.llm import embedding_params

    path = make_classifier(tmp_path / "classifier", "llama", num_labels=1)
    llm = LLM(path, **ENGINE)
    with pytest.raises(ValueError, match=r"classification model \(LlamaForSequenceClassification, num_labels=1\): "
                                         r"it cannot generate text; use LLM.classify or POST /classify"):
        llm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="it cannot compute embeddings .*use LLM.classify"):
        llm.embed("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="normalize and dimensions apply to embeddings"):
        llm.classify("hello", PoolingParams(normalize=True), use_tqdm=False)
    with pytest.raises(ValueError, match="task 'embed' were given to LLM.classify"):
        llm.classify("hello", PoolingParams(task="embed"), use_tqdm=False)
    assert len(llm.classify(["hello", "world"], use_tqdm=False)) == 2  # (the engine keeps serving)

    generative = LLM(make_checkpoint(tmp_path / "generative", "llama"), **ENGINE)
    with pytest.raises(ValueError, match=r"generative model \(LlamaForCausalLM\) with no classification head; "
                                         r"classify needs a \*ForSequenceClassification checkpoint"):
        generative.classify("hello", use_tqdm=False)
    # an embedding request on it ends with its embedding and no token (pooling requests never sample),
    # with its prompt logprobs if it asked for them
    params = embedding_params(PoolingParams())
    params.prompt_logprobs = 0
    (out,) = generative.generate("hello world", params, use_tqdm=False)
    assert out.embedding is not None and out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "stop"
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None


def test_the_xla_runner_refuses_a_classifier_at_load(tmp_path):
    from halserve.config import EngineConfig
    from halserve.models.loader import get_model_info
    from halserve.platforms.cpu import CpuPlatform
    from halserve.worker.xla_model_runner import XlaModelRunner

    config = EngineConfig(model=make_classifier(tmp_path, "qwen2"), dtype="float32", max_model_len=64)
    platform = CpuPlatform()
    runner = XlaModelRunner(config, platform, get_model_info(config, platform))
    with pytest.raises(ValueError, match="Qwen2ForSequenceClassification is a classification model, which the XLA "
                                         "model runner .* cannot serve"):
        runner.load_model()


@pytest.mark.slow  # two spawned ranks: ~10 s of CPU
def test_tensor_parallel_2_matches_transformers(tmp_path):
    """The score head is replicated on both ranks; the decoder's row-parallel sums make the
    pooled hidden state whole on each."""
    path = make_classifier(tmp_path, "qwen2", num_labels=3)
    reference = hf_logits(path)
    rng = random.Random(5)
    prompts = [random_ids(rng, n) for n in (9, 40)]
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    try:
        outs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    for ids, out in zip(prompts, outs):
        assert_close(out.outputs.probs, reference(ids).softmax(-1))

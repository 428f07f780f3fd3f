"""POST /classify (vLLM's) on a classification checkpoint, through httpx (the openai client has no
classify call): class probabilities and raw logits equal transformers', labels from id2label,
usage, concurrent requests; 400s for bad input, for the generation and embedding routes on a
classifier and for /classify on a generative model (the offline side:
tests/models/test_sequence_classification.py)."""
from __future__ import annotations

import concurrent.futures

import httpx
import pytest
import torch
from classifier_factory import hf_logits, make_classifier
from server_utils import MAX_MODEL_LEN, VOCAB_SIZE, ServerProcess

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')

NAME = "tiny-classifier"
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
INPUTS = ["hello world, tell me about the quick brown fox", "paris", "the capital city of france is paris"]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> str:
    return make_classifier(tmp_path_factory.mktemp("classifier"), "qwen2", num_labels=3, id2label=LABELS)


@pytest.fixture(scope="module")
def classify_server(classifier, tmp_path_factory):
    args = [classifier, "--platform", "cpu", "--served-model-name", NAME, "--max-model-len", str(MAX_MODEL_LEN),
            "--num-kv-blocks", "128", "--block-size", "16", "--max-num-batched-tokens", "32",
            "--log-level", "warning"]
    srv = ServerProcess(args, str(tmp_path_factory.mktemp("logs") / "classify.log")).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(classifier):
    """(tokenize, logits): the checkpoint's tokenizer, and transformers' logits of token ids."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(classifier).encode, hf_logits(classifier)


def classify(server: ServerProcess, **body) -> httpx.Response:
    return httpx.post(server.url + "/classify", json={"model": NAME, **body}, timeout=60)


def assert_close(got: list[float], want: torch.Tensor) -> None:
    assert len(got) == len(want) and (torch.tensor(got) - want).abs().max() < 1e-5, (got, want.tolist())


def test_classify_matches_transformers(classify_server, reference):
    tokenize, logits_of = reference
    ids = [tokenize(text) for text in INPUTS]
    logits = [logits_of(i) for i in ids]
    r = classify(classify_server, input=INPUTS)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("classify-") and body["object"] == "list" and body["model"] == NAME
    assert isinstance(body["created"], int)
    num_tokens = sum(map(len, ids))
    assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0,
                             "prompt_tokens_details": None}
    for i, (want, item) in enumerate(zip(logits, body["data"])):
        assert item["index"] == i and item["num_classes"] == 3
        assert item["label"] == LABELS[int(want.argmax())]
        assert_close(item["probs"], want.softmax(-1))
    # token ids (several lists, or one), raw logits (vLLM's names: activation, use_activation, softmax)
    for flag in ("activation", "use_activation", "softmax"):
        raw = classify(classify_server, input=ids, **{flag: False}).json()["data"]
        for want, item in zip(logits, raw):
            assert_close(item["probs"], want)
    (one,) = classify(classify_server, input=ids[2]).json()["data"]
    assert_close(one["probs"], logits[2].softmax(-1))
    # truncate_prompt_tokens classifies the last k tokens, as transformers does on them alone
    (cut,) = classify(classify_server, input=INPUTS[0], truncate_prompt_tokens=4, activation=False).json()["data"]
    assert_close(cut["probs"], logits_of(ids[0][-4:]))


def test_concurrent_classify_requests_each_get_their_own_result(classify_server, reference):
    """Requests arriving together share engine steps (prefills chunked at 32 tokens); each gets
    its own input's logits."""
    tokenize, logits_of = reference
    texts = [*INPUTS, " ".join(INPUTS * 3)] * 3
    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
        replies = list(pool.map(lambda text: classify(classify_server, input=text, activation=False), texts))
    for text, reply in zip(texts, replies):
        assert reply.status_code == 200, reply.text
        assert_close(reply.json()["data"][0]["probs"], logits_of(tokenize(text)))


@pytest.mark.parametrize("body, expected", [
    ({"input": ""}, "the prompt is empty"),
    ({"input": []}, "input must not be empty"),
    ({"input": 5}, "input: must be a string"),
    ({"input": [1, VOCAB_SIZE]}, "out of range"),
    ({"input": [5] * (MAX_MODEL_LEN + 1)}, f"a classify input may have at most max_model_len = {MAX_MODEL_LEN}"),
    ({"input": "a", "truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "greater than max_model_len"),
    ({"input": "a", "activation": True, "use_activation": False}, "activation and use_activation disagree"),
    ({"input": "a", "activation": "yes"}, "activation"),
])
def test_bad_classify_requests_are_400(classify_server, body, expected):
    r = httpx.post(classify_server.url + "/classify", json={"model": NAME, **body}, timeout=30)
    assert r.status_code == 400 and expected in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("route, body, expected", [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 4}, "it cannot generate text"),
    ("/v1/completions", {"prompt": "hello", "use_beam_search": True, "n": 2, "temperature": 0}, "cannot generate"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "it cannot generate text"),
    ("/v1/embeddings", {"input": "hello"}, "it cannot compute embeddings"),
    ("/score", {"text_1": "a", "text_2": "b"}, "it cannot compute embeddings"),
])
def test_generation_and_embedding_routes_on_a_classifier_are_400(classify_server, route, body, expected):
    r = httpx.post(classify_server.url + route, json={"model": NAME, **body}, timeout=30)
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and expected in message and "use LLM.classify or POST /classify" in message, r.text
    assert httpx.get(classify_server.url + "/health").status_code == 200


def test_classify_on_a_generative_model_is_400(server):
    r = httpx.post(server.url + "/classify", json={"input": "hello"}, timeout=30)
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "generative model (LlamaForCausalLM) with no classification head" in message
    assert "*ForSequenceClassification checkpoint" in message, r.text

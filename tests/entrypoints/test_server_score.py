"""POST /score and /rerank (vLLM's, for embedding models): each score is the cosine similarity of
two texts' embeddings, the same as /v1/embeddings' vectors, transformers' hidden states pooled
alike, and the offline LLM.score; each distinct text is embedded once."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest
import torch
from server_utils import MAX_MODEL_LEN, SERVED_NAME, ServerProcess, server_args
from test_server_load import scrape, wait_idle

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')

QUERY = "what is the capital of france?"
DOCS = ["paris is the capital of france", "the quick brown fox jumps", "berlin is in germany", "a fox"]
TOO_LONG = "fox " * (2 * MAX_MODEL_LEN)


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": SERVED_NAME, **body}, timeout=60)


def embed(url: str, texts: list[str], **extra) -> list[list[float]]:
    body = {"input": texts, "encoding_format": "float", **extra}
    out = httpx.post(url + "/v1/embeddings", json=body, timeout=60)
    assert out.status_code == 200, out.text
    return [item["embedding"] for item in out.json()["data"]]


def num_tokens(server, text: str) -> int:
    return httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["count"]


def num_finished(url: str) -> float:
    """Requests finished so far, whatever their finish reason (``wait_idle`` first)."""
    metrics = wait_idle(url)
    return sum(value for key, value in metrics.items() if key.startswith("halserve:request_success_total"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers' final hidden state (after the final norm) at each text's last token: the
    tiny model's default pooling (LAST)."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModel.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        return {text: model(tokenizer(text, return_tensors="pt").input_ids).last_hidden_state[0, -1].numpy()
                for text in [QUERY, *DOCS]}


def test_score_pairs_one_to_n_and_n_to_n_as_cosine_of_embeddings(server, reference):
    vectors = dict(zip([QUERY, *DOCS], embed(server.url, [QUERY, *DOCS])))
    # 1:1, strings
    out = post(server, "/score", {"text_1": QUERY, "text_2": DOCS[0]})
    assert out.status_code == 200, out.text
    body = out.json()
    assert body["object"] == "list" and body["model"] == SERVED_NAME and body["id"].startswith("score-")
    assert isinstance(body["created"], int)
    (item,) = body["data"]
    assert item["index"] == 0 and item["object"] == "score"
    assert item["score"] == pytest.approx(cosine(vectors[QUERY], vectors[DOCS[0]]), abs=1e-5)
    assert item["score"] == pytest.approx(cosine(reference[QUERY], reference[DOCS[0]]), abs=1e-5)
    # 1:N (text_1 a string or a list of one), in text_2's order
    for text_1 in (QUERY, [QUERY]):
        data = post(server, "/v1/score", {"text_1": text_1, "text_2": DOCS}).json()["data"]
        assert [d["index"] for d in data] == list(range(len(DOCS)))
        for d, doc in zip(data, DOCS):
            assert d["score"] == pytest.approx(cosine(reference[QUERY], reference[doc]), abs=1e-5)
    # N:N pairs element-wise
    firsts = [DOCS[1], QUERY, DOCS[3]]
    data = post(server, "/v1/score", {"text_1": firsts, "text_2": DOCS[:3]}).json()["data"]
    assert len(data) == 3
    for d, a, b in zip(data, firsts, DOCS[:3]):
        assert d["score"] == pytest.approx(cosine(reference[a], reference[b]), abs=1e-5)
    assert data[2]["score"] < 0.999  # (distinct texts: not all scores are trivially 1)


def test_each_distinct_text_is_embedded_once_and_counted_once(server):
    texts = [DOCS[0], DOCS[1], DOCS[0], QUERY]  # (one repeat, and the query among the documents)
    before = num_finished(server.url)
    out = post(server, "/score", {"text_1": QUERY, "text_2": texts})
    assert out.status_code == 200, out.text
    assert num_finished(server.url) - before == 3  # QUERY, DOCS[0], DOCS[1]
    scores = [d["score"] for d in out.json()["data"]]
    assert scores[0] == pytest.approx(scores[2], abs=1e-9) and scores[3] == pytest.approx(1.0, abs=1e-5)
    want = sum(num_tokens(server, text) for text in (QUERY, DOCS[0], DOCS[1]))
    usage = out.json()["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] == want and usage["completion_tokens"] == 0
    before = num_finished(server.url)
    rerank = post(server, "/rerank", {"query": QUERY, "documents": DOCS}).json()
    assert num_finished(server.url) - before == len(DOCS) + 1
    assert rerank["usage"]["total_tokens"] == sum(num_tokens(server, text) for text in [QUERY, *DOCS])


def test_rerank_sorts_best_first_and_keeps_top_n(server, reference):
    want = [cosine(reference[QUERY], reference[doc]) for doc in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    bodies = [post(server, path, {"query": QUERY, "documents": DOCS}) for path in ("/rerank", "/v1/rerank",
                                                                                       "/v2/rerank")]
    for out in bodies:
        assert out.status_code == 200, out.text
        body = out.json()
        assert body["id"].startswith("rerank-") and body["model"] == SERVED_NAME
        assert [r["index"] for r in body["results"]] == order
        for result in body["results"]:
            assert result["document"] == {"text": DOCS[result["index"]]}
            assert result["relevance_score"] == pytest.approx(want[result["index"]], abs=1e-5)
    for top_n, count in ((2, 2), (1, 1), (0, len(DOCS)), (10, len(DOCS))):
        results = post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": top_n}).json()["results"]
        assert [r["index"] for r in results] == order[:count]


def test_truncate_prompt_tokens_embeds_the_last_tokens(server):
    out = post(server, "/score", {"text_1": QUERY, "text_2": [DOCS[0], TOO_LONG], "truncate_prompt_tokens": 8})
    assert out.status_code == 200, out.text
    query, doc, long = embed(server.url, [QUERY, DOCS[0], TOO_LONG], truncate_prompt_tokens=8)
    scores = [d["score"] for d in out.json()["data"]]
    assert scores == pytest.approx([cosine(query, doc), cosine(query, long)], abs=1e-5)
    assert out.json()["usage"]["prompt_tokens"] == 3 * 8


@pytest.mark.parametrize("path, body, expected, param", [
    ("/score", {"text_1": [], "text_2": "a"}, "text_1 must not be empty", "text_1"),
    ("/score", {"text_1": "a", "text_2": []}, "text_2 must not be empty", "text_2"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "must pair 1:1, 1:N", "text_1"),
    ("/score", {"text_1": ["a", "b"], "text_2": "c"}, "got 2 and 1 texts", "text_1"),
    ("/score", {"text_1": "a", "text_2": ["b", 5]}, "text_2: must be a string or a list of strings", "text_2"),
    ("/score", {"text_1": "a"}, "text_2: Field required", "text_2"),
    ("/score", {"text_1": "a", "text_2": ["b", ""]}, "text_2[1]: the prompt is empty", "text_2[1]"),
    ("/v1/score", {"text_1": TOO_LONG, "text_2": "b"}, "text_1: ", "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be",
     "truncate_prompt_tokens"),
    ("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 10 ** 6}, "greater than max_model_len",
     "truncate_prompt_tokens"),
    ("/rerank", {"query": "a", "documents": []}, "documents must not be empty", "documents"),
    ("/rerank", {"documents": ["a"]}, "query: Field required", "query"),
    ("/rerank", {"query": 5, "documents": ["a"]}, "query: Input should be a valid string", "query"),
    ("/rerank", {"query": "a", "documents": "a"}, "documents: Input should be a valid array", "documents"),
    ("/rerank", {"query": "a", "documents": ["a", 3]}, "documents[1]: Input should be a valid string", "documents[1]"),
    ("/v1/rerank", {"query": "a", "documents": ["a"], "top_n": -1}, "top_n: Input should be greater than", "top_n"),
    ("/v2/rerank", {"query": "a", "documents": ["b", TOO_LONG]}, "documents[1]: ", "documents[1]"),
])
def test_bad_requests_are_400_naming_the_field_and_queue_nothing(server, path, body, expected, param):
    before = num_finished(server.url)
    out = post(server, path, body)
    assert out.status_code == 400 and expected in out.json()["error"]["message"], out.text
    assert out.json()["error"]["param"] == param
    assert num_finished(server.url) == before  # (the valid texts ahead of the bad one never ran)


@pytest.mark.parametrize("path, body", [("/score", {"text_1": "a", "text_2": "b"}),
                                        ("/v2/rerank", {"query": "a", "documents": ["b"]})])
def test_unknown_model_is_404(server, path, body):
    out = httpx.post(server.url + path, json={"model": "nope", **body}, timeout=30)
    assert out.status_code == 404 and out.json()["error"]["code"] == "model_not_found", out.text


def test_offline_score_equals_the_servers(checkpoint, server):
    from halserve import LLM, ScoringRequestOutput

    llm = LLM(checkpoint, platform="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=64)
    try:
        outputs = llm.score(QUERY, DOCS, use_tqdm=False)
        served = post(server, "/score", {"text_1": QUERY, "text_2": DOCS}).json()["data"]
        assert all(isinstance(out, ScoringRequestOutput) and out.finished for out in outputs)
        assert [out.outputs.score for out in outputs] == pytest.approx([d["score"] for d in served], abs=1e-5)
        query_ids = llm.get_tokenizer().encode(QUERY)
        assert outputs[0].prompt_token_ids == query_ids + llm.get_tokenizer().encode(DOCS[0])
        pairs = llm.score(DOCS[:2], [QUERY, DOCS[3]], use_tqdm=False)
        served = post(server, "/score", {"text_1": DOCS[:2], "text_2": [QUERY, DOCS[3]]}).json()["data"]
        assert [out.outputs.score for out in pairs] == pytest.approx([d["score"] for d in served], abs=1e-5)
        for args, message in [((DOCS[:2], DOCS[:3]), "got 2 and 3 texts"),
                              (([], DOCS), "text_1 must not be empty"),
                              ((QUERY, [DOCS[0], 7]), r"text_2\[1\] must be a string, got int"),
                              ((QUERY, [DOCS[0], ""]), r"text_2\[1\]: the prompt is empty"),
                              ((TOO_LONG, DOCS), "text_1: the input has")]:
            with pytest.raises(ValueError, match=message):
                llm.score(*args, use_tqdm=False)
        with pytest.raises(ValueError, match="lora_request must be one LoRARequest"):
            llm.score(QUERY, DOCS, use_tqdm=False, lora_request=[None] * 4)
        repeated = llm.score(QUERY, [DOCS[0], DOCS[1], DOCS[0]], use_tqdm=False)
        assert len({out.request_id for out in repeated}) == 3  # (a pair repeated is still its own result)
        assert not llm.llm_engine.has_unfinished_requests()
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def second_server(checkpoint, tmp_path_factory):
    """A second server: the LoRA adapter "sql", and steps of 32 tokens (embeddings over several
    steps; a request of many texts runs long enough to leave midway)."""
    from lora_factory import make_adapter

    adapter = make_adapter(tmp_path_factory.mktemp("score_lora"), checkpoint, r=8, seed=11)
    args = server_args(checkpoint, "--enable-lora", "--lora-modules", json.dumps({"name": "sql", "path": adapter}),
                       "--max-lora-rank", "16", "--max-num-batched-tokens", "32")
    srv = ServerProcess(args, str(tmp_path_factory.mktemp("logs") / "score_lora.log")).wait_ready()
    yield srv
    srv.stop()


def test_lora_adapter_selected_by_model(second_server):
    texts = [QUERY, *DOCS]
    adapted = embed(second_server.url, texts, model="sql")
    base = embed(second_server.url, texts, model=SERVED_NAME)
    for model, vectors in (("sql", adapted), (SERVED_NAME, base)):
        body = {"model": model, "query": QUERY, "documents": DOCS}
        results = httpx.post(second_server.url + "/v1/rerank", json=body, timeout=60).json()["results"]
        for result in results:
            want = cosine(vectors[0], vectors[1 + result["index"]])
            assert result["relevance_score"] == pytest.approx(want, abs=1e-5)
    assert max(abs(cosine(adapted[0], a) - cosine(base[0], b)) for a, b in zip(adapted[1:], base[1:])) > 1e-3


def test_client_disconnect_aborts_the_embeddings(second_server):
    url = second_server.url
    # 4,000 distinct documents reach the engine core in one round trip (AsyncLLM.submit_all); the client
    # leaves once the first are being embedded, and the rest is aborted rather than embedded for nobody.
    # Each document spans a few 32-token steps, so most are still waiting when the client leaves. (Before
    # the batch was queued in one round trip, queueing itself took seconds and stopped at the disconnect.)
    documents = [f"document {i}: " + "the quick brown fox jumps over the lazy dog " * 8 for i in range(4000)]
    num_finished_before = num_finished(url)
    before = wait_idle(url)
    key = 'halserve:request_success_total{finished_reason="abort"}'

    async def leave_midway():
        async with httpx.AsyncClient(timeout=60) as aclient:
            request = asyncio.ensure_future(aclient.post(url + "/rerank",
                                                         json={"query": QUERY, "documents": documents}))
            deadline = time.monotonic() + 30
            while scrape(url)["halserve:prompt_tokens_total"] == before["halserve:prompt_tokens_total"]:
                assert time.monotonic() < deadline and not request.done(), "the embeddings did not start"
                await asyncio.sleep(0.02)
            request.cancel()  # (the connection closes)
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(leave_midway())
    time.sleep(3)  # (time enough to queue many more, had the queueing gone on)
    num_ended = num_finished(url) - num_finished_before
    time.sleep(1)
    assert num_finished(url) - num_finished_before == num_ended  # nothing more arrives
    after = wait_idle(url)
    aborted = after[key] - before[key]
    assert aborted > len(documents) // 2, (aborted, num_ended)  # most never ran
    assert 0 <= num_ended - aborted < len(documents) // 4, (aborted, num_ended)  # few were embedded
    assert after["halserve:kv_cache_usage_perc"] == pytest.approx(before["halserve:kv_cache_usage_perc"], abs=1e-9)

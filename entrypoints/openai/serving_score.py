"""POST /score and /rerank (vLLM's, for embedding models): each score is the cosine similarity of
two texts' embeddings, computed as /v1/embeddings computes them (``halserve.scoring``). Every
distinct text of a request is embedded once, all in one batch: a bad text queues nothing, and a
client that goes away aborts them all. Usage counts the tokens embedded."""
from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from halserve.entrypoints.openai.errors import BadRequestError
from halserve.entrypoints.openai.protocol import UsageInfo, random_id
from halserve.entrypoints.openai.score_protocol import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreRequest,
    ScoreResponse,
    ScoreResponseData,
)
from halserve.entrypoints.openai.serving_engine import ClientDisconnected, OpenAIServing
from halserve.scoring import ScoringBatch, pair_scores, pair_texts


class OpenAIServingScore:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def score(self, req: ScoreRequest, raw_request: Request) -> Response:
        model = self.serving.check_model(req.model)
        batch = _pair(req.text_1, req.text_2, ("text_1", "text_2"))
        request_id = random_id("score")
        scored = await self._run(batch, model, req.truncate_prompt_tokens, request_id, raw_request)
        if scored is None:
            return Response(status_code=499)
        scores, num_tokens = scored
        response = ScoreResponse(id=request_id, created=int(time.time()), model=model,
                                 data=[ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)],
                                 usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens))
        return JSONResponse(response.model_dump())

    async def rerank(self, req: RerankRequest, raw_request: Request) -> Response:
        model = self.serving.check_model(req.model)
        batch = _pair(req.query, req.documents, ("query", "documents"))
        request_id = random_id("rerank")
        scored = await self._run(batch, model, req.truncate_prompt_tokens, request_id, raw_request)
        if scored is None:
            return Response(status_code=499)
        scores, num_tokens = scored
        results = [RerankResult(index=i, document=RerankDocument(text=req.documents[i]), relevance_score=s)
                   for i, s in enumerate(scores)]
        results.sort(key=lambda result: -result.relevance_score)  # (stable: ties keep document order)
        response = RerankResponse(id=request_id, model=model, results=results[:req.top_n or None],
                                  usage=RerankUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))
        return JSONResponse(response.model_dump())

    async def _run(self, batch: ScoringBatch, model: str, truncate_prompt_tokens: int | None, request_id: str,
                   raw_request: Request) -> tuple[list[float], int] | None:
        """(per pair, its score; the number of tokens embedded), or None when the client left
        first (the embeddings are then aborted)."""
        from halserve.entrypoints.llm import embedding_params
        from halserve.pooling_params import PoolingParams

        serving = self.serving
        try:
            params = embedding_params(PoolingParams(), truncate_prompt_tokens)
        except ValueError as exc:
            raise BadRequestError(str(exc), param="truncate_prompt_tokens") from None
        try:
            streams = await serving.add_requests(batch.texts, params, request_id,
                                                 lora_request=serving.lora_request(model),
                                                 prompt_params=batch.text_params, raw_request=raw_request)
            finals = await serving.collect(streams, raw_request)
        except ClientDisconnected:
            return None
        if any(final.embedding is None for final in finals):
            raise BadRequestError("this platform's model runner does not compute embeddings", code="unsupported")
        scores = pair_scores(batch, [final.embedding for final in finals])
        return scores, sum(len(final.prompt_token_ids) for final in finals)


def _pair(text_1: str | list[str], text_2: str | list[str], names: tuple[str, str]) -> ScoringBatch:
    try:
        return pair_texts(text_1, text_2, names)
    except ValueError as exc:
        raise BadRequestError(str(exc), param=str(exc).split(" ", 1)[0]) from None  # (it starts with the field)

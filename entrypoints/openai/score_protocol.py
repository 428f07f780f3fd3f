"""Bodies of vLLM's /score (and /v1/score) and its Jina/Cohere-style /rerank (and /v1/rerank,
/v2/rerank) for embedding models (pydantic models)."""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, Field

from halserve.entrypoints.openai.protocol import OpenAIModel, UsageInfo


class ScoreRequest(OpenAIModel):
    type_hints: ClassVar[dict[str, str]] = {
        "text_1": "a string or a list of strings",
        "text_2": "a string or a list of strings",
    }

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]  # paired with text_1 1:1, 1:N or N:N (halserve.scoring)
    truncate_prompt_tokens: int | None = None  # vLLM's: embed each text's last k tokens (-1: as many as fit)


class ScoreResponseData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo


class RerankRequest(OpenAIModel):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int = Field(default=0, ge=0)  # the best this many documents; 0: all of them
    truncate_prompt_tokens: int | None = None


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int  # the document's position in the request's ``documents``
    document: RerankDocument
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]  # best first

"""POST /v1/embeddings (OpenAI's): one embedding per input, the final hidden states of the input
pooled as the model's pooler config says (LAST, MEAN or CLS: ``halserve.pooling_params``), as
float lists or base64 float32."""
from __future__ import annotations

import base64
import time
from typing import ClassVar, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from halserve.entrypoints.openai.errors import BadRequestError
from halserve.entrypoints.openai.protocol import OpenAIModel, UsageInfo, random_id
from halserve.entrypoints.openai.serving_completions import normalize_prompts
from halserve.entrypoints.openai.serving_engine import ClientDisconnected, OpenAIServing


class EmbeddingRequest(OpenAIModel):
    type_hints: ClassVar[dict[str, str]] = {
        "input": "a string, a list of strings, a list of token ids (integers) or a list of such lists",
    }

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM extra: embed each input's last k tokens (-1: as many as fit)
    # vLLM extra (None: the model's default, see halserve.pooler_config)
    normalize: bool | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class OpenAIServingEmbedding:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, req: EmbeddingRequest, raw_request: Request) -> Response:
        from halserve.entrypoints.llm import embedding_params
        from halserve.pooling_params import PoolingParams

        serving = self.serving
        model = serving.check_model(req.model)
        try:
            params = embedding_params(PoolingParams(normalize=req.normalize, dimensions=req.dimensions),
                                      req.truncate_prompt_tokens)
        except ValueError as exc:
            field = "truncate_prompt_tokens" if str(exc).startswith("truncate_prompt_tokens") else "dimensions"
            raise BadRequestError(str(exc), param=field) from None
        request_id = random_id("embd")
        try:
            streams = await serving.add_requests(normalize_prompts(req.input, "input"), params, request_id,
                                                 lora_request=serving.lora_request(model),
                                                 message_params={"dimensions": "dimensions"}, raw_request=raw_request)
            finals = await serving.collect(streams, raw_request)
        except ClientDisconnected:
            return Response(status_code=499)
        data = []
        for i, final in enumerate(finals):
            if final.embedding is None:
                raise BadRequestError("this platform's model runner does not compute embeddings", code="unsupported")
            vector: list[float] | str = final.embedding
            if req.encoding_format == "base64":  # OpenAI's: little-endian float32 bytes
                vector = base64.b64encode(np.asarray(final.embedding, dtype="<f4").tobytes()).decode("ascii")
            data.append(EmbeddingData(index=i, embedding=vector))
        prompt_tokens = sum(len(f.prompt_token_ids) for f in finals)
        response = EmbeddingResponse(id=request_id, created=int(time.time()), model=model, data=data,
                                     usage=UsageInfo(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens))
        return JSONResponse(response.model_dump())

"""POST /classify (vLLM's, for classification models: ``*ForSequenceClassification`` checkpoints,
reward models included): per input, the class probabilities of the model's ``score`` head on its
last token's final hidden state (``halserve.models.sequence_classification``), the most likely
class's ``id2label`` name and the number of classes. ``activation: false`` returns the raw logits.
A generative model answers 400 naming the routes it serves (``halserve.pooling_params.check_task``),
as a classification model does on the generation and embedding routes."""
from __future__ import annotations

import time
from typing import ClassVar, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from halserve.entrypoints.openai.errors import BadRequestError
from halserve.entrypoints.openai.protocol import OpenAIModel, UsageInfo, random_id
from halserve.entrypoints.openai.serving_completions import normalize_prompts
from halserve.entrypoints.openai.serving_engine import ClientDisconnected, OpenAIServing

# vLLM's names for the activation switch over its versions: softmax (first), activation, use_activation
ACTIVATION_FIELDS = ("activation", "use_activation", "softmax")


class ClassificationRequest(OpenAIModel):
    type_hints: ClassVar[dict[str, str]] = {
        "input": "a string, a list of strings, a list of token ids (integers) or a list of such lists",
    }

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # classify each input's last k tokens (-1: as many as fit)
    # apply the model's activation (softmax / sigmoid); false: raw logits. None: true
    activation: bool | None = None
    use_activation: bool | None = None  # (vLLM's newer name)
    softmax: bool | None = None  # (vLLM's older name)

    def activation_flag(self) -> bool | None:
        """The activation switch, whichever of vLLM's names set it; a 400 when two disagree."""
        given = {name: getattr(self, name) for name in ACTIVATION_FIELDS if getattr(self, name) is not None}
        if len(set(given.values())) > 1:
            raise BadRequestError(f"{' and '.join(given)} disagree ({given}); give one of them", param="activation")
        return next(iter(given.values()), None)


class ClassificationData(BaseModel):
    index: int
    label: str | None  # id2label of the most likely class (None when the config names none)
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


class OpenAIServingClassification:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, req: ClassificationRequest, raw_request: Request) -> Response:
        from halserve.entrypoints.llm import embedding_params
        from halserve.pooling_params import PoolingParams

        serving = self.serving
        model = serving.check_model(req.model)
        pooling = PoolingParams(task="classify", activation=req.activation_flag())
        try:
            params = embedding_params(pooling, req.truncate_prompt_tokens)
        except ValueError as exc:
            raise BadRequestError(str(exc), param="truncate_prompt_tokens") from None
        request_id = random_id("classify")
        try:
            streams = await serving.add_requests(normalize_prompts(req.input, "input"), params, request_id,
                                                 lora_request=serving.lora_request(model), raw_request=raw_request)
            finals = await serving.collect(streams, raw_request)
        except ClientDisconnected:
            return Response(status_code=499)
        id2label = serving.engine.model_info.id2label
        data = []
        for i, final in enumerate(finals):
            if final.probs is None:
                raise BadRequestError("this platform's model runner does not classify", code="unsupported")
            best = max(range(len(final.probs)), key=final.probs.__getitem__)  # (argmax: the first of ties)
            data.append(ClassificationData(index=i, label=id2label.get(best), probs=final.probs,
                                           num_classes=len(final.probs)))
        prompt_tokens = sum(len(f.prompt_token_ids) for f in finals)
        response = ClassificationResponse(id=request_id, created=int(time.time()), model=model, data=data,
                                          usage=UsageInfo(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens))
        return JSONResponse(response.model_dump())

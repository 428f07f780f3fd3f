"""Bodies of /v1/models, /tokenize and /detokenize (pydantic models)."""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, model_validator

from halserve.entrypoints.openai.chat_protocol import ChatMessage, ChatTool, check_template_kwargs
from halserve.entrypoints.openai.protocol import OpenAIModel


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "halserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    # (halserve's) which code runs the model: "halserve" (native) or "transformers" (the Transformers
    # modeling backend, --model-impl); None for an adapter
    model_impl: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIModel):
    """``{prompt}`` (completions style) or ``{messages}`` (chat style)."""

    type_hints: ClassVar[dict[str, str]] = {"prompt": "a string (the text to tokenize)"}

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    # chat style, as in /v1/chat/completions: the same prompt the chat request would get
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of 'prompt' or 'messages'")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        check_template_kwargs(self.chat_template_kwargs)
        return self

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.tools:
            kwargs.setdefault("tools", [t.model_dump(exclude_none=True) for t in self.tools])
        return kwargs


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str

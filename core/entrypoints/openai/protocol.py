"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests are validated strictly (a string is not a number, a number is not a string):
anything that does not fit is a 400 naming the field. Sampling ranges are checked once,
by ``SamplingParams``; the models here only check shapes and API-level rules. Unknown
fields are ignored (as OpenAI's and vLLM's servers do) and logged.
"""
from __future__ import annotations

import logging
import math
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from halserve.entrypoints.openai.errors import BadRequestError

logger = logging.getLogger(__name__)

# Fields that map 1:1 onto SamplingParams when the client sets them.
_SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "allowed_token_ids",
    "prompt_logprobs",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    """Base of request bodies: strict types, unknown fields ignored (and logged)."""

    model_config = ConfigDict(strict=True, extra="allow")
    # union-typed fields -> what they accept (for readable 400 messages)
    type_hints: ClassVar[dict[str, str]] = {
        "prompt": "a string, a list of strings, a list of token ids (integers) or a list of such lists",
        "stop": "a string or a list of strings",
    }

    @model_validator(mode="after")
    def _log_unknown(self) -> "OpenAIModel":
        extra = self.model_extra or {}
        if extra:
            logger.info("ignoring unknown request fields: %s", ", ".join(sorted(extra)))
        return self


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingRequest(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM extras)."""

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False
    structured_outputs: dict[str, Any] | None = None
    # older vLLM names of the same constraints
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None

    @model_validator(mode="after")
    def _check_common(self) -> "SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available with stream=true (as in vLLM); "
                             "for a completion, echo with logprobs streams the prompt's logprobs")
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()):  # "12", not "-1", " 12", "x" or "²"
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers as strings), got {key!r}")
            if not math.isfinite(bias):
                raise ValueError(f"logit_bias values must be finite numbers in [-100, 100], got {bias!r} for {key!r}")
        return self

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams keywords the client set (model defaults fill the rest)."""
        kwargs = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        structured = self._structured_outputs()
        if structured is not None:
            kwargs["structured_outputs"] = structured
        if self.logit_bias:
            # OpenAI's range: biases outside [-100, 100] are clamped (as vLLM does)
            kwargs["logit_bias"] = {int(key): min(100.0, max(-100.0, bias)) for key, bias in self.logit_bias.items()}
        return kwargs

    def _structured_outputs(self) -> dict[str, Any] | None:
        """One constraint from response_format, structured_outputs or a guided_* field."""
        sources: dict[str, dict[str, Any]] = {}
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type", "text")
            if kind == "json_object":
                sources["response_format"] = {"json_object": True}
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise BadRequestError(
                        'response_format of type "json_schema" needs json_schema.schema, a JSON schema object',
                        param="response_format",
                    )
                sources["response_format"] = {"json": schema}
            elif kind != "text":
                raise BadRequestError(
                    f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                    param="response_format",
                )
        if self.structured_outputs is not None:
            sources["structured_outputs"] = dict(self.structured_outputs)
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                sources[f"guided_{name}"] = {name: value}
        if len(sources) > 1:
            raise BadRequestError(f"give one output constraint, not several: {', '.join(sources)}")
        return next(iter(sources.values()), None)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


# ---------------------------------------------------------------------- completions
class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("best_of is not supported (only best_of == n)")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        return self

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = super().sampling_kwargs()
        kwargs["max_tokens"] = self.max_tokens
        if self.logprobs is not None:
            kwargs["logprobs"] = self.logprobs
            if self.echo:  # the echoed prompt's tokens come with their logprobs too
                kwargs["prompt_logprobs"] = max(self.logprobs, self.prompt_logprobs or 0)
        return kwargs


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One entry of vLLM's ``prompt_logprobs``: a token's logprob, rank and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs in responses: None for the first prompt token, then per prompt token
# {token id: PromptLogprob} for the token and its top alternatives
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extra: when the request set prompt_logprobs


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------- chat
class ChatContentPart(OpenAIModel):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> "ChatContentPart":
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are not supported; only 'text' parts are")
        if self.text is None:
            raise ValueError("a 'text' content part needs a 'text' field")
        return self


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        if self.tools:
            raise ValueError("tools are not supported by this server")
        if self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice is not supported by this server")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = super().sampling_kwargs()
        # Chat has no 16-token default: unset means up to the context length.
        kwargs["max_tokens"] = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.logprobs:
            kwargs["logprobs"] = self.top_logprobs or 0
        return kwargs

    def template_messages(self) -> list[dict[str, Any]]:
        return [
            {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in self.messages
        ]


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extra: when the request set prompt_logprobs


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------- models, tokenize
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "halserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIModel):
    """``{prompt}`` (completions style) or ``{messages}`` (chat style)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_of(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of 'prompt' or 'messages'")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str

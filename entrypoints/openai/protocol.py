"""Request and response bodies of the OpenAI-compatible API (pydantic models): what every
request shares, and /v1/completions (chat: ``chat_protocol``; models and tokenize:
``tokenize_protocol``; output constraints: ``constraints``).

Requests are validated strictly (a string is not a number, a number is not a string):
anything that does not fit is a 400 naming the field. Sampling ranges are checked once,
by ``SamplingParams``; the models here only check shapes and API-level rules. Unknown
fields are ignored (as OpenAI's and vLLM's servers do) and logged.
"""
from __future__ import annotations

import functools
import logging
import math
import time
import typing
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from halserve.entrypoints.openai.constraints import output_constraint

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
    "bad_words",
    "truncate_prompt_tokens",
    "prompt_logprobs",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)


MAX_N = 128  # choices per prompt over HTTP (OpenAI's limit): n builds that many requests up front
_MAX_TOKEN_ID_DIGITS = 19  # a longer logit_bias key is past any vocabulary (and int64)


@functools.cache
def _not_nullable(model: type[BaseModel]) -> frozenset[str]:
    """Fields of ``model`` with a default whose type does not admit None."""
    return frozenset(
        name for name, info in model.model_fields.items()
        if not info.is_required() and type(None) not in typing.get_args(info.annotation)
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

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """``null`` for a field that cannot be null means "not set" (some clients send
        ``"stream": null``): its default applies."""
        if not isinstance(data, dict):
            return data
        return {key: value for key, value in data.items() if value is not None or key not in _not_nullable(cls)}

    @model_validator(mode="after")
    def _log_unknown(self) -> OpenAIModel:
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
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
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
    use_beam_search: bool = False  # the n best beams are the choices (serving_beam_search)
    length_penalty: float | None = None  # use_beam_search's final ranking (vLLM's; default 1.0)
    priority: int = 0  # vLLM's: lower runs first under --scheduling-policy priority (fcfs takes only 0)

    @model_validator(mode="after")
    def _check_common(self) -> SamplingRequest:
        if self.length_penalty is not None and not self.use_beam_search:
            raise ValueError("length_penalty only applies to beam search: set use_beam_search to true, "
                             "or leave length_penalty out")
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be between 1 and {MAX_N}, got {self.n}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available with stream=true (as in vLLM); "
                             "for a completion, echo with logprobs streams the prompt's logprobs")
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()):  # "12", not "-1", " 12", "x" or "²"
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers as strings), got {key!r}")
            if len(key) > _MAX_TOKEN_ID_DIGITS:  # (past any vocabulary; int() refuses over 4300 digits)
                raise ValueError(f"logit_bias keys must be token ids of the model's vocabulary, got a {len(key)}-digit "
                                 f"number ({key[:12]}...)")
            if not math.isfinite(bias):
                raise ValueError(f"logit_bias values must be finite numbers in [-100, 100], got {bias!r} for {key!r}")
        return self

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams keywords the client set (model defaults fill the rest)."""
        kwargs = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        structured = output_constraint(self)
        if structured is not None:
            kwargs["structured_outputs"] = structured
        if self.logit_bias:
            # (SamplingParams clamps the biases to OpenAI's [-100, 100], as vLLM does)
            kwargs["logit_bias"] = {int(key): bias for key, bias in self.logit_bias.items()}
        return kwargs

    @property
    def calls_tools(self) -> bool:
        """tool_choice forces tool calls (chat only)."""
        return False

    @functools.cached_property
    def constrained(self) -> bool:
        """A structured output (or a forced tool call) generates the reply (asked per streamed
        chunk: computed once)."""
        return output_constraint(self) is not None

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
    def _check_completion(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("best_of is not supported (only best_of == n)")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 generates nothing: set echo to true to get the prompt (and with logprobs "
                             "its logprobs) back, or ask for at least 1 token")
        return self

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) back, nothing generated, as
        lm-evaluation-harness asks to score a text."""
        return self.echo and self.max_tokens == 0

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = super().sampling_kwargs()
        kwargs["max_tokens"] = 1 if self.echo_only else self.max_tokens  # (the one token is not returned)
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

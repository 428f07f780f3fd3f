"""Request and response bodies of Anthropic's Messages API (``POST /v1/messages`` and
``/v1/messages/count_tokens``), and their translation into a ``ChatCompletionRequest``, so a
Messages request runs through the chat pipeline: the chat template, sampling, the tool-call
parser and the reasoning parser.

Requests follow ``protocol``'s conventions (strict types, unknown fields ignored and logged).
What maps where:

    system (string or text blocks)      -> a system message
    user text / image blocks            -> a user message (image -> an image_url part)
    user tool_result blocks             -> tool messages (before the user's other blocks)
    assistant text / thinking / tool_use -> content / reasoning_content / tool_calls
    max_tokens, stop_sequences          -> max_completion_tokens, stop
    tools[].input_schema                -> tools[].function.parameters
    tool_choice auto / any / tool / none -> "auto" / "required" / a named function / "none"
    thinking disabled                   -> chat_template_kwargs.enable_thinking false, no reasoning
    output_config.format (json_schema)  -> response_format json_schema (structured outputs)
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from halserve.entrypoints.openai.chat_protocol import ChatCompletionRequest, str_or_list
from halserve.entrypoints.openai.errors import BadRequestError, validation_message
from halserve.entrypoints.openai.protocol import OpenAIModel

__all__ = [
    "ContentBlock",
    "CountTokensRequest",
    "CountTokensResponse",
    "MessagesRequest",
    "MessagesResponse",
    "MessagesUsage",
    "anthropic_id",
]

# vLLM extras a Messages request may carry (the anthropic client's ``extra_body``); passed on as is
CHAT_EXTRAS = (
    "seed", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "ignore_eos",
    "stop_token_ids", "allowed_token_ids", "bad_words", "logit_bias", "structured_outputs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "skip_special_tokens", "include_stop_str_in_output",
)
BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")


def anthropic_id(prefix: str) -> str:
    """An id shaped like Anthropic's: ``msg_...``, ``toolu_...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


class ImageSource(OpenAIModel):
    """``{"type": "base64", "media_type": "image/png", "data": ...}`` or ``{"type": "url", "url": ...}``."""

    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None

    @model_validator(mode="after")
    def _check_source(self) -> ImageSource:
        if self.type == "base64" and (self.data is None or self.media_type is None):
            raise ValueError('a base64 image source needs "media_type" (e.g. "image/png") and "data"')
        if self.type == "url" and self.url is None:
            raise ValueError('a url image source needs "url"')
        return self

    def data_url(self) -> str:
        """The image as chat's image_url takes it."""
        return f"data:{self.media_type};base64,{self.data}" if self.type == "base64" else str(self.url)


class ContentBlock(OpenAIModel):
    """One content block of a message; which fields it needs depends on ``type``."""

    type: str
    text: str | None = None  # text
    source: ImageSource | None = None  # image
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use: the call's arguments
    tool_use_id: str | None = None  # tool_result: the call it answers
    content: str_or_list(ContentBlock) | None = None  # type: ignore[valid-type]  # tool_result
    is_error: bool | None = None  # tool_result
    thinking: str | None = None  # thinking
    signature: str | None = None  # thinking (not checked: this server signs nothing)
    data: str | None = None  # redacted_thinking
    cache_control: dict[str, Any] | None = None  # accepted; prefix caching is automatic
    citations: Any = None  # accepted, ignored

    @model_validator(mode="after")
    def _check_block(self) -> ContentBlock:
        needs = {"text": ("text",), "image": ("source",), "tool_use": ("id", "name", "input"),
                 "tool_result": ("tool_use_id",), "thinking": ("thinking",), "redacted_thinking": ()}
        if self.type not in needs:
            raise ValueError(f"content blocks of type {self.type!r} are not supported by this server; "
                             f"use {', '.join(BLOCK_TYPES)}")
        missing = [name for name in needs[self.type] if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a {self.type!r} block needs {', '.join(repr(m) for m in missing)}")
        return self

    def result_text(self) -> str:
        """A tool_result's content as text (its text blocks joined)."""
        if isinstance(self.content, str) or self.content is None:
            return self.content or ""
        return "".join(block.text or "" for block in self.content)


class InputMessage(OpenAIModel):
    role: str
    content: str_or_list(ContentBlock)  # type: ignore[valid-type]

    @field_validator("role")
    @classmethod
    def _check_role(cls, role: str) -> str:
        if role not in ("user", "assistant"):
            hint = ' (a system prompt goes in the top-level "system" field)' if role == "system" else ""
            raise ValueError(f"role must be 'user' or 'assistant', got {role!r}{hint}")
        return role

    def blocks(self) -> list[ContentBlock]:
        if isinstance(self.content, str):
            return [ContentBlock(type="text", text=self.content)]
        return list(self.content)


class SystemBlock(OpenAIModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # accepted; prefix caching is automatic
    citations: Any = None


class Tool(OpenAIModel):
    """A client tool: ``{"name", "description", "input_schema"}``. Anthropic's server tools (a
    ``type`` such as ``web_search_20250305``) run on Anthropic's side and are refused."""

    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    cache_control: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _client_tool(self) -> Tool:
        if self.type not in (None, "custom"):
            raise ValueError(f"tool {self.name!r} has type {self.type!r}: Anthropic's server tools are not "
                             "available here; describe a client tool with name, description and input_schema")
        if self.input_schema is None:
            raise ValueError(f"tool {self.name!r} needs an input_schema (a JSON schema of its input)")
        return self


class ToolChoice(OpenAIModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError('tool_choice of type "tool" needs the tool\'s "name"')
        return self


class ThinkingConfig(OpenAIModel):
    """``{"type": "enabled", "budget_tokens": N}``, ``{"type": "adaptive"}`` or ``{"type": "disabled"}``.
    The budget is accepted but not enforced: the model thinks until it closes its think block
    (max_tokens bounds thinking and reply together)."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = None


class OutputFormat(OpenAIModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(OpenAIModel):
    """``{"format": {"type": "json_schema", "schema": {...}}}``: the reply is generated to the schema
    (structured outputs). ``effort`` is accepted and not used."""

    effort: str | None = None
    format: OutputFormat | None = None


class MessagesBase(OpenAIModel):
    """What /v1/messages and /v1/messages/count_tokens share: the conversation and its tools."""

    model: str | None = None
    messages: list[InputMessage] = Field(min_length=1)
    system: str_or_list(SystemBlock) | None = None  # type: ignore[valid-type]
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extra: passed to the chat template

    @model_validator(mode="after")
    def _check_conversation(self) -> MessagesBase:
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not self.tools:
            raise ValueError(f'tool_choice {{"type": "{choice.type}"}} needs tools')
        if choice is not None and choice.type == "tool":
            names = [tool.name for tool in self.tools or ()]
            if choice.name not in names:
                raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools "
                                 f"({', '.join(names)})")
        return self

    @property
    def wants_thinking(self) -> bool:
        return self.thinking is not None and self.thinking.type != "disabled"

    def first_image_param(self) -> str | None:
        """Where the first image block is, e.g. ``messages[1].content[0]``; None without images."""
        for i, message in enumerate(self.messages):
            for j, block in enumerate(message.content if isinstance(message.content, list) else ()):
                if block.type == "image":
                    return f"messages[{i}].content[{j}]"
        return None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as /v1/chat/completions messages."""
        out: list[dict[str, Any]] = []
        if self.system is not None:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            out.append({"role": "system", "content": system})
        for i, message in enumerate(self.messages):
            if message.role == "user":
                out.extend(self._user_messages(i, message))
            else:
                out.append(self._assistant_message(i, message))
        return out

    @staticmethod
    def _user_messages(i: int, message: InputMessage) -> list[dict[str, Any]]:
        if isinstance(message.content, str):
            return [{"role": "user", "content": message.content}]
        tool_messages, parts = [], []
        for j, block in enumerate(message.content):
            if block.type == "tool_result":
                if isinstance(block.content, list) and any(b.type != "text" for b in block.content):
                    raise BadRequestError(f"messages[{i}].content[{j}]: only text blocks are supported inside a "
                                          "tool_result; send an image as an image block of the user message",
                                          param=f"messages[{i}].content[{j}].content")
                tool_messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                      "content": block.result_text()})
            elif block.type == "text":
                parts.append({"type": "text", "text": block.text})
            elif block.type == "image":
                parts.append({"type": "image_url", "image_url": {"url": block.source.data_url()}})
            else:
                raise BadRequestError(f"messages[{i}].content[{j}]: a user message cannot hold a {block.type!r} "
                                      "block (only text, image and tool_result)", param=f"messages[{i}].content[{j}]")
        return tool_messages + ([{"role": "user", "content": parts}] if parts or not tool_messages else [])

    @staticmethod
    def _assistant_message(i: int, message: InputMessage) -> dict[str, Any]:
        if isinstance(message.content, str):
            return {"role": "assistant", "content": message.content}
        text, thinking, calls = [], [], []
        for j, block in enumerate(message.content):
            if block.type == "text":
                text.append(block.text)
            elif block.type == "thinking":
                thinking.append(block.thinking)
            elif block.type == "tool_use":
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input)}})
            elif block.type != "redacted_thinking":  # (opaque: nothing to show the model)
                raise BadRequestError(f"messages[{i}].content[{j}]: an assistant message cannot hold a "
                                      f"{block.type!r} block (only text, thinking and tool_use)",
                                      param=f"messages[{i}].content[{j}]")
        out: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        if thinking:
            out["reasoning_content"] = "".join(thinking)
        if calls:
            out["tool_calls"] = calls
        return out

    def chat_fields(self) -> dict[str, Any]:
        """The /v1/chat/completions fields of the conversation, tools and thinking."""
        fields: dict[str, Any] = {"model": self.model, "messages": self.chat_messages()}
        if self.tools:
            fields["tools"] = [{"type": "function", "function": {
                "name": tool.name, "description": tool.description, "parameters": tool.input_schema}}
                for tool in self.tools]
            choice = self.tool_choice or ToolChoice(type="auto")
            fields["tool_choice"] = {
                "auto": "auto", "any": "required", "none": "none",
                "tool": {"type": "function", "function": {"name": choice.name}},
            }[choice.type]
            fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        kwargs = dict(self.chat_template_kwargs or {})
        if self.thinking is not None:
            kwargs.setdefault("enable_thinking", self.wants_thinking)  # (Qwen3's templates read it)
            fields["include_reasoning"] = self.wants_thinking
        if kwargs:
            fields["chat_template_kwargs"] = kwargs
        return fields

    def to_chat_request(self) -> ChatCompletionRequest:
        """The same request for the chat pipeline; a field it refuses is a 400."""
        try:
            return ChatCompletionRequest.model_validate_json(json.dumps(self.chat_fields()))
        except ValidationError as exc:
            message, param = validation_message(exc.errors(include_url=False))
            raise BadRequestError(message, param=param) from None


class CountTokensRequest(MessagesBase):
    """``POST /v1/messages/count_tokens``: a Messages request without the sampling fields."""


class MessagesRequest(MessagesBase):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # {"user_id": ...}: accepted, not used
    service_tier: str | None = None  # accepted, not used
    output_config: OutputConfig | None = None
    # vLLM extras (the anthropic client's extra_body); see CHAT_EXTRAS
    seed: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logit_bias: dict[str, float] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _max_tokens_required(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("max_tokens") is None:
            raise ValueError("max_tokens is required: the most tokens to generate (Anthropic's API has no default)")
        return data

    @model_validator(mode="after")
    def _check_sampling(self) -> MessagesRequest:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.stop_sequences is not None and any(not s for s in self.stop_sequences):
            raise ValueError("stop_sequences must not hold empty strings")
        return self

    def chat_fields(self) -> dict[str, Any]:
        fields = super().chat_fields()
        fields["max_completion_tokens"] = self.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.stop_sequences:
            fields["stop"] = list(self.stop_sequences)
        if self.output_config is not None and self.output_config.format is not None:
            fields["response_format"] = {"type": "json_schema",
                                         "json_schema": {"name": "output", "schema": self.output_config.format.schema_}}
        for name in CHAT_EXTRAS:
            value = getattr(self, name)
            if value is not None and name not in fields:
                fields[name] = value
        return fields


# ---------------------------------------------------------------------- responses
class MessagesUsage(BaseModel):
    input_tokens: int = 0  # the prompt's tokens, as the engine saw them (images expanded)
    output_tokens: int = 0
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]  # text, thinking and tool_use blocks, in that order
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None  # the stop sequence that ended the reply (stop_reason "stop_sequence")
    usage: MessagesUsage


class CountTokensResponse(BaseModel):
    input_tokens: int

"""Request and response bodies of /v1/chat/completions (pydantic models; the conventions of
``protocol``: strict types, unknown fields ignored and logged)."""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator, model_serializer, model_validator

from halserve.entrypoints.openai.constraints import named_tool, template_tool_call
from halserve.entrypoints.openai.protocol import (
    OpenAIModel,
    PromptLogprobs,
    SamplingRequest,
    UsageInfo,
    random_id,
)
from halserve.sampling_params import MAX_LOGPROBS


def str_or_list(item: type) -> Any:
    """``str | list[item]`` that reports only the branch the value took when it is invalid (a
    plain union reports every branch). The tags are named like the branches pydantic names,
    which ``errors`` leaves out of a field's path."""
    tag = f"list[{item.__name__}]"
    return Annotated[
        Annotated[str, Tag("str")] | Annotated[list[item], Tag(tag)],  # type: ignore[valid-type]
        Discriminator(lambda value: "str" if isinstance(value, str) else tag),
    ]


class ImageURL(OpenAIModel):
    url: str  # data:image/...;base64,..., http(s)://... or file://... (halserve.multimodal.media)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor sets the resolution


class ChatContentPart(OpenAIModel):
    """``{"type": "text", "text": ...}`` or ``{"type": "image_url", "image_url": {"url": ...}}`` (the
    url may also be given as a plain string, as vLLM takes it)."""

    type: str
    text: str | None = None
    image_url: ImageURL | None = None

    @field_validator("image_url", mode="before")
    @classmethod
    def _url_string(cls, value: Any) -> Any:
        return {"url": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_part(self) -> ChatContentPart:
        if self.type == "text":
            if self.text is None:
                raise ValueError("a 'text' content part needs a 'text' field")
        elif self.type == "image_url":
            if self.image_url is None:
                raise ValueError("an 'image_url' content part needs an 'image_url' field: {\"url\": \"data:image/png;"
                                 "base64,...\"} or an http(s) URL")
        else:
            raise ValueError(f"content parts of type {self.type!r} are not supported; only 'text' and 'image_url' "
                             "parts are")
        return self

    @property
    def url(self) -> str | None:
        """An image part's URL; None for a text part."""
        return self.image_url.url if self.image_url is not None else None


class ChatFunction(OpenAIModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments


class ChatTool(OpenAIModel):
    type: Literal["function"]
    function: ChatFunction


class PastToolCallFunction(OpenAIModel):
    name: str
    arguments: str | dict[str, Any] = "{}"  # JSON text as OpenAI sends it (an object is taken too)


class PastToolCall(OpenAIModel):
    """A call an assistant made earlier in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: PastToolCallFunction


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str_or_list(ChatContentPart) | None = None  # type: ignore[valid-type]
    name: str | None = None
    tool_calls: list[PastToolCall] | None = None  # an assistant's earlier calls (multi-turn)
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning: str | None = None  # an assistant's earlier reasoning (vLLM's field) ...
    reasoning_content: str | None = None  # ... or its older name; templates read reasoning_content

    @model_validator(mode="after")
    def _images_from_users(self) -> ChatMessage:
        if self.role != "user" and self.image_urls():
            raise ValueError(f"images are allowed in user messages only; this {self.role!r} message has an "
                             "'image_url' content part (move the image to a user message)")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it: its content the joined text, or, with images, the
        list vision models' templates read (``{"type": "image"}`` and ``{"type": "text", ...}`` parts,
        in order; each image part becomes the model's image placeholder)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.image_urls():
            message["content"] = [{"type": "image"} if part.type == "image_url" else {"type": "text", "text": part.text}
                                  for part in self.content or ()]
        if self.name:
            message["name"] = self.name
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [template_tool_call(call.model_dump(exclude_none=True)) for call in self.tool_calls]
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return message

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)

    def image_urls(self) -> list[str]:
        """The URLs of its image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [url for part in self.content if (url := part.url) is not None]


# chat_template_kwargs keys the server passes to the template itself (a second value is a
# TypeError deep in transformers) -> how the client sets the same thing
_TEMPLATE_ARGS = {
    "chat_template": "the server renders with its own chat template (--chat-template); it cannot be sent per request",
    "add_generation_prompt": "set the request's own add_generation_prompt field",
    "continue_final_message": "set the request's own continue_final_message field",
    "messages": "the conversation is the request's messages",
    "conversation": "the conversation is the request's messages",
    "tokenize": "the server renders the template to text and tokenizes it itself",
    "return_assistant_tokens_mask": "the server renders the template to text and tokenizes it itself",
}


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """ValueError if ``chat_template_kwargs`` sets an argument the server gives the template itself."""
    for key in kwargs or ():
        if key in _TEMPLATE_ARGS:
            raise ValueError(f"chat_template_kwargs must not set {key!r}: {_TEMPLATE_ARGS[key]}")


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True  # False: at most one call
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # with --reasoning-parser: False leaves the reasoning out

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none", "auto"):
                raise ValueError("tool_choice 'required' or a named function needs tools")
        elif isinstance(choice, dict):
            named_tool(self)  # the name must be one of the tools
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise ValueError(f"max_completion_tokens must be at least 1, got {self.max_completion_tokens}")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        check_template_kwargs(self.chat_template_kwargs)
        return self

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = super().sampling_kwargs()
        # Chat has no 16-token default: unset means up to the context length.
        kwargs["max_tokens"] = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.logprobs:
            kwargs["logprobs"] = self.top_logprobs or 0
        return kwargs

    @property
    def auto_tools(self) -> bool:
        """Tools with tool_choice 'auto': the model may call them in its own format."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    @property
    def calls_tools(self) -> bool:
        """tool_choice forces tool calls ('required' or a named function)."""
        return bool(self.tools) and self.tool_choice not in (None, "none", "auto")

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]

    def image_urls(self) -> list[str]:
        """The URLs of every image part, in message order (the order of the placeholders in the prompt)."""
        return [url for m in self.messages for url in m.image_urls()]

    def first_image_param(self) -> str | None:
        """Where the first image part is, e.g. ``messages[1].content[0]``; None without images."""
        for i, message in enumerate(self.messages):
            for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
                if part.type == "image_url":
                    return f"messages[{i}].content[{j}]"
        return None

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs, plus the tools (unless tool_choice is 'none')."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.tools and self.tool_choice != "none":
            kwargs.setdefault("tools", [t.model_dump(exclude_none=True) for t in self.tools])
        return kwargs


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl-tool"))
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None  # with --reasoning-parser: the model's thinking (vLLM's name) ...
    reasoning_content: str | None = None  # ... and its older name (DeepSeek's API), the same text
    tool_calls: list[ToolCall] = Field(default_factory=list)


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


class DeltaFunctionCall(BaseModel):
    name: str | None = None  # on a call's first delta only
    arguments: str | None = None  # text to append to the call's arguments

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """One streamed piece of a call, as OpenAI streams them: the first has the call's ``id``,
    ``type`` and ``function.name``; the next ones add to ``function.arguments`` (fields that
    are not set are left out of the JSON)."""

    index: int  # which call of the message
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall = Field(default_factory=DeltaFunctionCall)

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


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

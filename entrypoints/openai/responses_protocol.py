"""Request and response bodies of /v1/responses, OpenAI's Responses API as vLLM serves it
(pydantic models, with ``protocol``'s conventions: strict types, unknown fields ignored and logged).

A request is a chat request in another envelope: ``ResponsesRequest.chat_request`` turns
``instructions`` and ``input`` into chat messages, ``max_output_tokens`` into
``max_completion_tokens`` and ``text.format`` into ``response_format``, so /v1/responses shares
the chat path's template rendering, sampling parameters, reasoning parser and structured
outputs. A user message's ``input_image`` parts (an http(s) or data URL) become chat's
``image_url`` parts. Function tools become chat's tools (``function_call`` and
``function_call_output`` input items its assistant tool calls and tool messages) and the calls the
model writes come back as ``function_call`` output items, found by chat's tool-call parser. What
it cannot honour (other tool types, stored responses, background mode, files, images by
``file_id``) is a 400 naming the field. The response bodies have the shapes of the ``openai`` client's
``openai.types.responses`` types.
"""
from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from halserve.entrypoints.openai.chat_protocol import ChatCompletionRequest, str_or_list
from halserve.entrypoints.openai.protocol import OpenAIModel, SamplingRequest

__all__ = [
    "FunctionCallItem",
    "IncompleteDetails",
    "OutputMessage",
    "ReasoningItem",
    "ResponsesRequest",
    "ResponsesResponse",
    "ResponseUsage",
    "item_id",
]


def item_id(prefix: str) -> str:
    """OpenAI's id shape: ``resp_...`` for a response, ``msg_...`` / ``rs_...`` for its items."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------------- request
TEXT_PARTS = ("input_text", "output_text")  # a message's parts: what was said, what the model said
REASONING_PARTS = ("reasoning_text", "summary_text")  # a reasoning item's (passed back from an output)


IMAGE_PART = "input_image"  # a user message's image: {"type": "input_image", "image_url": URL}


class InputPart(OpenAIModel):
    type: str
    text: str | None = None
    image_url: str | None = None  # an input_image's: an http(s) or data:image/...;base64,... URL
    file_id: str | None = None  # an input_image's uploaded file: refused (nothing is stored)
    detail: Literal["auto", "low", "high"] | None = None  # an input_image's; accepted, not used

    @model_validator(mode="after")
    def _check_part(self) -> InputPart:
        if self.type == IMAGE_PART:
            if self.file_id is not None:
                raise ValueError("input_image parts with a file_id are not supported (this server stores no files); "
                                 "give the image as image_url: an https:// URL or data:image/png;base64,...")
            if self.image_url is None:
                raise ValueError("an 'input_image' content part needs an 'image_url': an https:// URL or "
                                 "data:image/png;base64,...")
            return self
        if self.type not in TEXT_PARTS + REASONING_PARTS:
            raise ValueError(f"content parts of type {self.type!r} are not supported (no files or audio); "
                             "only 'input_text', 'input_image' and 'output_text' parts are")
        if self.text is None:
            raise ValueError(f"an {self.type!r} content part needs a 'text' field")
        return self

    def chat_part(self) -> dict[str, Any]:
        """The part as chat's content part: ``text`` or ``image_url``."""
        if self.type != IMAGE_PART:
            return {"type": "text", "text": self.text}
        image_url = {"url": self.image_url} if self.detail is None else {"url": self.image_url, "detail": self.detail}
        return {"type": "image_url", "image_url": image_url}


class InputItem(OpenAIModel):
    """One item of a list ``input``: a message (``type`` may be left out, as OpenAI allows), or a
    reasoning item passed back from an earlier response's output (its text goes to the next
    assistant message's ``reasoning``, as chat's)."""

    type: str = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str_or_list(InputPart) | None = None  # type: ignore[valid-type]
    summary: list[InputPart] | None = None  # a reasoning item's
    call_id: str | None = None  # a function_call's (and the function_call_output answering it)
    name: str | None = None  # a function_call's function
    arguments: str | None = None  # a function_call's arguments, JSON text
    output: str | None = None  # a function_call_output's result
    id: str | None = None  # (an earlier output item's id, status and encrypted reasoning: not used)
    status: str | None = None
    encrypted_content: str | None = None

    @model_validator(mode="after")
    def _check_item(self) -> InputItem:
        parts = self.content if isinstance(self.content, list) else []
        if self.type == "message":
            if self.role is None:
                raise ValueError("a message item needs a role: 'user', 'system', 'developer' or 'assistant'")
            if self.content is None:
                raise ValueError("a message item needs content: a string or a list of 'input_text' parts")
            if self.role != "user" and any(part.type == IMAGE_PART for part in parts):
                raise ValueError(f"images are allowed in user messages only; this {self.role!r} message has an "
                                 "'input_image' content part (move the image to a user message)")
            allowed = TEXT_PARTS + (IMAGE_PART,)
        elif self.type == "reasoning":
            allowed = REASONING_PARTS
        elif self.type in ("function_call", "function_call_output"):
            needed = ("call_id", "name", "arguments") if self.type == "function_call" else ("call_id", "output")
            missing = [field for field in needed if getattr(self, field) is None]
            if missing:
                raise ValueError(f"a {self.type!r} item needs {', '.join(missing)}")
            allowed = ()
        else:
            raise ValueError(f"input items of type {self.type!r} are not supported; only 'message' items are "
                             "(and 'reasoning', 'function_call' and 'function_call_output' items from an earlier "
                             "response's output and your tools' results)")
        for part in parts + (self.summary or []):
            if part.type not in allowed:
                raise ValueError(f"a {self.type!r} item cannot hold {part.type!r} content parts")
        return self

    def text(self) -> str:
        """A message's text, or a reasoning item's reasoning (its summary does not count)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content or ())

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(part.type == IMAGE_PART for part in self.content)

    def chat_content(self) -> str | list[dict[str, Any]]:
        """A message's content as chat's: its text, or with images the list of text and image_url parts."""
        return [part.chat_part() for part in self.content] if self.has_images() else self.text()


class TextFormat(OpenAIModel):
    """``text.format``: free text, any JSON object, or JSON to a schema (chat's response_format)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> TextFormat:
        if self.type == "json_schema" and (not self.name or self.schema_ is None):
            raise ValueError('a text.format of type "json_schema" needs a name and a schema (a JSON schema object)')
        return self

    def response_format(self) -> dict[str, Any]:
        """The same constraint as chat's ``response_format``."""
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name, "schema": self.schema_, "strict": self.strict}
        return {"type": "json_schema", "json_schema": spec}


class TextConfig(OpenAIModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


# field -> (is this value refused?, why): what /v1/responses cannot honour is a 400 naming it
_REFUSED = {
    "previous_response_id": (
        lambda value: value is not None,
        "this server does not store responses, so it cannot continue one: send the whole conversation "
        "as input (an earlier response's output items are valid input items)",
    ),
    "background": (lambda value: value, "background mode needs stored responses, which this server does not keep"),
    "conversation": (lambda value: value is not None, "this server does not store conversations"),
    "prompt": (lambda value: value is not None, "stored prompt templates are not supported: send the text as input"),
    "tools": (
        lambda value: any(not isinstance(t, dict) or t.get("type") != "function" for t in value or ()),
        "only function tools are supported ({'type': 'function', 'name': ..., 'parameters': {...}}); "
        "built-in tools (web_search, file_search, code_interpreter, ...) are not",
    ),
    "tool_choice": (
        lambda value: not (value in (None, "none", "auto", "required")
                           or isinstance(value, dict) and value.get("type") == "function"
                           and isinstance(value.get("name"), str)),
        "tool_choice is 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
    ),
    "top_logprobs": (lambda value: bool(value), "logprobs are not returned by /v1/responses on this server"),
    "include": (
        lambda value: any(name != "reasoning.encrypted_content" for name in value or ()),
        "only 'reasoning.encrypted_content' is accepted (and none is returned: reasoning comes as text)",
    ),
    "truncation": (lambda value: value == "auto", "only 'disabled' is supported; vLLM's truncate_prompt_tokens "
                                                  "keeps a prompt's last tokens"),
    "n": (lambda value: value not in (None, 1), "a response has one output (n is chat's)"),
    "response_format": (lambda value: value is not None, "/v1/responses takes text.format (response_format is chat's)"),
    "prompt_logprobs": (lambda value: value is not None, "prompt logprobs are not returned by /v1/responses"),
    "max_output_tokens": (lambda value: value is not None and value < 1, "must be at least 1"),
    "use_beam_search": (lambda value: value, "beam search is served by /v1/completions and /v1/chat/completions"),
}


class ResponsesRequest(SamplingRequest):
    """OpenAI's fields, plus every vLLM sampling extra chat takes (top_k, min_p,
    repetition_penalty, stop, structured_outputs, ...)."""

    input: str_or_list(InputItem)  # type: ignore[valid-type]
    instructions: str | None = None  # a system message ahead of the input
    max_output_tokens: int | None = None
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None  # accepted: thinking follows the template and --reasoning-parser
    metadata: dict[str, str] | None = None  # echoed back
    store: bool | None = None  # accepted; nothing is stored
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # vLLM extra, as chat's (e.g. Qwen3's {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator(*_REFUSED)
    @classmethod
    def _refuse(cls, value: Any, info: Any) -> Any:
        refused, why = _REFUSED[info.field_name]
        if refused(value):
            raise ValueError(why)
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, value: Any, info: Any) -> Any:
        if value not in (None, "none", "auto") and not info.data.get("tools"):
            raise ValueError("tool_choice 'required' or a function needs tools")
        return value

    @field_validator("input")
    @classmethod
    def _has_a_message(cls, value: str | list[InputItem]) -> str | list[InputItem]:
        if isinstance(value, list) and not any(item.type == "message" for item in value):
            raise ValueError("input needs at least one message item")
        return value

    @model_validator(mode="after")
    def _one_constraint(self) -> ResponsesRequest:
        others = [name for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                                    "guided_grammar") if getattr(self, name) is not None]
        if self.text_format.type != "text" and others:
            raise ValueError(f"give one output constraint, not several: text.format, {', '.join(others)}")
        return self

    @property
    def text_format(self) -> TextFormat:
        return self.text.format if self.text is not None and self.text.format is not None else TextFormat(type="text")

    def chat_messages(self) -> list[dict[str, Any]]:
        """``instructions`` as a system message, then the input's messages; a reasoning item's
        text goes with the assistant message right after it."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        reasoning = None
        for item in self.input:
            if item.type == "reasoning":
                reasoning = item.text()
                continue
            if item.type == "function_call":  # (the calls of one turn: one assistant message)
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and reasoning is None:
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                    if reasoning is not None:
                        messages[-1]["reasoning"] = reasoning
                reasoning = None
                continue
            if item.type == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
                continue
            message = {"role": item.role, "content": item.chat_content()}
            if item.role == "assistant" and reasoning is not None:
                message["reasoning"] = reasoning
            messages.append(message)
            reasoning = None
        return messages

    def first_image_param(self) -> str | None:
        """Where the first input_image part is, e.g. ``input[0].content[1]``; None without images."""
        for i, item in enumerate(self.input if isinstance(self.input, list) else ()):
            for j, part in enumerate(item.content if item.has_images() else ()):
                if part.type == IMAGE_PART:
                    return f"input[{i}].content[{j}]"
        return None

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request this one amounts to (its sampling fields as sent)."""
        shared = {name: getattr(self, name) for name in SamplingRequest.model_fields if name in self.model_fields_set}
        if self.text_format.type != "text":
            shared["response_format"] = self.text_format.response_format()
        if self.tools:  # (the Responses API's flat function tools, as chat's)
            shared["tools"] = [{"type": "function", "function": {
                key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}}
                for tool in self.tools]
            choice = self.tool_choice
            shared["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}} \
                if isinstance(choice, dict) else choice
            shared["parallel_tool_calls"] = self.parallel_tool_calls
        return ChatCompletionRequest.model_validate({
            **shared,
            "messages": self.chat_messages(),
            "max_completion_tokens": self.max_output_tokens,
            "chat_template_kwargs": self.chat_template_kwargs,
        })


# ---------------------------------------------------------------------- response
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """With --reasoning-parser: the model's thinking, as text (no summary, nothing encrypted)."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: ItemStatus


class FunctionCallItem(BaseModel):
    """A call of one of the request's function tools (run it, and send its result back as a
    ``function_call_output`` input item with this ``call_id``)."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str  # JSON text
    status: ItemStatus


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # generated tokens up to the end of the thinking (its end tag included)


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] | None = None


class ResponsesResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    model: str
    status: Literal["in_progress", "completed", "incomplete", "cancelled", "failed"]
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    output: list[ReasoningItem | OutputMessage | FunctionCallItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    # the request's settings, echoed (sampling ones as applied)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[Any] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    background: bool = False
    store: bool = False  # nothing is kept, whatever the request asked
    truncation: Literal["disabled"] = "disabled"

    @classmethod
    def in_progress(cls, req: ResponsesRequest, response_id: str, model: str, created_at: int,
                    temperature: float, top_p: float) -> ResponsesResponse:
        """The response as announced before any output: the request's settings echoed."""
        return cls(
            id=response_id, created_at=created_at, model=model, status="in_progress",
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            temperature=temperature, top_p=top_p, metadata=req.metadata or {}, user=req.user,
            text={"format": req.text_format.model_dump(by_alias=True, exclude_none=True)},
            reasoning=req.reasoning, tool_choice=req.tool_choice or "auto", tools=list(req.tools or ()),
            parallel_tool_calls=req.parallel_tool_calls,
        )

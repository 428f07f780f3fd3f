"""What a request constrains its output to, as a ``structured_outputs`` dict of SamplingParams:
OpenAI's ``response_format``, vLLM's ``structured_outputs`` and ``guided_*`` fields, and a
forced tool choice (a tool call is generated to the tool's JSON schema). Also how an
assistant's earlier tool calls reach a chat template."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from halserve.entrypoints.openai.errors import BadRequestError

if TYPE_CHECKING:  # pragma: no cover
    from halserve.entrypoints.openai.chat_protocol import ChatCompletionRequest, ChatTool
    from halserve.entrypoints.openai.protocol import SamplingRequest


def output_constraint(req: SamplingRequest) -> dict[str, Any] | None:
    """The request's one constraint (None: free text); two at once are a 400."""
    return next(iter(_constraint_sources(req).values()), None)


def constraint_messages(req: SamplingRequest) -> dict[str, str | None]:
    """``add_requests``' message_params: an engine error about the constraint names the request
    field that gave it (response_format, structured_outputs, guided_json, tool_choice...), and one
    about the output length (a max_tokens past the context) the length field the request used."""
    length = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
    return {"structured outputs": next(iter(_constraint_sources(req)), None), "max_tokens=": length}


def _constraint_sources(req: SamplingRequest) -> dict[str, dict[str, Any]]:
    """{the request field that gives it: the constraint}; two at once are a 400."""
    sources: dict[str, dict[str, Any]] = {}
    if req.calls_tools:
        sources["tool_choice"] = {"json": tool_calls_schema(req)}  # type: ignore[arg-type]
    fmt = req.response_format
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
    if req.structured_outputs is not None:
        sources["structured_outputs"] = dict(req.structured_outputs)
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{name}")
        if value is not None:
            sources[f"guided_{name}"] = {name: value}
    if len(sources) > 1:
        raise BadRequestError(f"give one output constraint, not several: {', '.join(sources)}")
    return sources


def named_tool(req: ChatCompletionRequest) -> ChatTool:
    """The tool a named tool_choice picks; ValueError if it names none of the tools."""
    choice = req.tool_choice
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ValueError('a named tool_choice is {"type": "function", "function": {"name": NAME}}')
    for tool in req.tools or ():
        if tool.function.name == name:
            return tool
    names = ", ".join(t.function.name for t in req.tools or ())
    raise ValueError(f"tool_choice names {name!r}, which is not among the tools ({names})")


def tool_calls_schema(req: ChatCompletionRequest) -> dict[str, Any]:
    """A forced tool call's JSON schema: a named function's arguments, or for 'required' a
    non-empty array of {"name", "parameters"} of any of the tools (one item at most without
    parallel_tool_calls)."""
    if isinstance(req.tool_choice, dict):
        return named_tool(req).function.parameters or {"type": "object"}
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"enum": [t.function.name]},
                "parameters": t.function.parameters or {"type": "object"},
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in req.tools or ()
    ]
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not req.parallel_tool_calls:
        array["maxItems"] = 1
    return array


def tool_schema_error(req: ChatCompletionRequest, param_format: str) -> BadRequestError | None:
    """Why a forced tool call's constraint did not compile, told of the tool at fault: a 400
    naming the first called tool whose parameters are not a valid JSON schema
    (``param_format``: the API's path to a tool's schema, e.g. ``"tools[{i}].function.parameters"``).
    None if each compiles alone (then the combined schema's own error stands)."""
    from halserve.structured_output import StructuredOutputsParams, validate

    chosen = named_tool(req) if isinstance(req.tool_choice, dict) else None
    for i, tool in enumerate(req.tools or ()):
        if chosen is not None and tool is not chosen:
            continue
        try:
            validate(StructuredOutputsParams(json=tool.function.parameters or {"type": "object"}))
        except ValueError as exc:
            param = param_format.format(i=i)
            reason = str(exc).removeprefix("structured outputs: ")
            return BadRequestError(f"{param} (tool {tool.function.name!r}): {reason}; fix the tool's schema",
                                   param=param)
    return None


def template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant's tool call as chat templates read it: arguments as an object (OpenAI
    sends them as JSON text), as vLLM passes them."""
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            pass  # not JSON: the template gets the text
    return {**call, "function": function}

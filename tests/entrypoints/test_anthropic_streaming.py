"""Streamed Messages replies without a server: recorded model outputs (hermes calls, a qwen3
think block) fed to the reply's event writer in pieces, read back with the ``anthropic``
client's own accumulator; the message equals the non-streamed one, the text streams as it is
written and each call's input arrives in several ``input_json_delta`` fragments."""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from halserve.entrypoints.anthropic.blocks import content_blocks
from halserve.entrypoints.anthropic.protocol import MessagesRequest
from halserve.entrypoints.anthropic.serving_messages import AnthropicServingMessages
from halserve.entrypoints.openai.reasoning import ReplyStart, get_reasoning_parser
from halserve.entrypoints.openai.serving_chat import OpenAIServingChat
from halserve.outputs import CompletionOutput

anthropic_streaming = pytest.importorskip("anthropic.lib.streaming._messages",
                                          reason="the stream is read back with the anthropic client (in dev)")

WEATHER = {"name": "get_weather", "input_schema": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}}}
CALL_WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
CALL_TIME = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>'

# recorded hermes outputs -> the blocks (type, text or (name, input)) of the reply
RECORDED = [
    (f"Let me check both.\n{CALL_WEATHER}\n{CALL_TIME}",
     [("text", "Let me check both."), ("tool_use", ("get_weather", {"city": "Paris", "days": 3})),
      ("tool_use", ("get_time", {"zone": "Europe/Paris"}))]),
    (CALL_TIME, [("tool_use", ("get_time", {"zone": "Europe/Paris"}))]),
    # text after a call is a text block after it
    (f"First the weather.\n{CALL_WEATHER}\nThen the time:\n{CALL_TIME}\n",
     [("text", "First the weather."), ("tool_use", ("get_weather", {"city": "Paris", "days": 3})),
      ("text", "Then the time:"), ("tool_use", ("get_time", {"zone": "Europe/Paris"}))]),
    # malformed calls are text, as the model wrote them
    ('Booking.\n<tool_call>{"name": "book_flight", "arguments": {}}</tool_call>',
     [("text", 'Booking.\n<tool_call>{"name": "book_flight", "arguments": {}}</tool_call>')]),
    ("<tool_call>not json</tool_call> and then some", [("text", "<tool_call>not json</tool_call> and then some")]),
    ("Paris is sunny; no tool needed.\n", [("text", "Paris is sunny; no tool needed.\n")]),
]


def serving(reasoning: str | None = None) -> AnthropicServingMessages:
    """The Messages endpoint on a stand-in server: what reply assembly reads of it (its parsers)."""
    parser = get_reasoning_parser(reasoning) if reasoning else None
    return AnthropicServingMessages(OpenAIServingChat(SimpleNamespace(tool_parser="hermes", reasoning_parser=parser)))


def chat_request(**body):
    body = {"max_tokens": 100, "messages": [{"role": "user", "content": "weather and time in Paris?"}], **body}
    return MessagesRequest.model_validate_json(json.dumps(body)).to_chat_request()


def output(text: str, finish: str | None) -> CompletionOutput:
    return CompletionOutput(index=0, text=text, token_ids=[0] * len(text), cumulative_logprob=None, logprobs=None,
                            finish_reason=finish)


def stream_events(messages: AnthropicServingMessages, chat_req, text: str, sizes: list[int],
                  start: ReplyStart | None = None) -> list[list[dict]]:
    """The reply's events (as sent: type and data), per piece of ``text`` fed (``sizes`` long)."""
    events = messages.message_events(chat_req, start, holdback=0)
    per_piece = [[events.start("msg_1", "m", 7)]]
    end = 0
    for size in sizes:
        end = min(len(text), end + size)
        per_piece.append(list(events.feed(output(text[:end], "stop" if end == len(text) else None), 7)))
        if end == len(text):
            break
    return [[read_event(e) for e in piece] for piece in per_piece]


def read_event(event: str) -> dict:
    name, data = event.strip().split("\n")
    payload = json.loads(data[len("data: "):])
    assert name == f"event: {payload['type']}"
    return payload


def final_message(per_piece: list[list[dict]]):
    """What ``stream.get_final_message()`` of the anthropic client makes of the events."""
    snapshot, json_bufs = None, {}
    for event in (e for piece in per_piece for e in piece):
        snapshot = anthropic_streaming.accumulate_event(event=event, current_snapshot=snapshot, json_bufs=json_bufs)
    return snapshot


def summary(blocks) -> list[tuple]:
    out = []
    for b in blocks:
        b = b if isinstance(b, dict) else b.model_dump()
        out.append((b["type"], b.get("text") or b.get("thinking") or (b["name"], b["input"])))
    return out


def pieces_of(text: str, how: str) -> list[int]:
    if how == "chars":
        return [1] * len(text)
    if how == "whole":
        return [len(text)]
    rng = random.Random(int(how))
    return [rng.randint(1, 9) for _ in range(len(text))]


@pytest.mark.parametrize("text, expected", RECORDED)
def test_streamed_message_is_the_non_streamed_one(text, expected):
    messages, chat_req = serving(), chat_request(tools=[WEATHER, TIME])
    whole = messages.reply_blocks(chat_req, output(text, "stop"), None)
    assert summary(whole) == expected
    for how in ("chars", "0", "1", "whole"):
        per_piece = stream_events(messages, chat_req, text, pieces_of(text, how))
        final = final_message(per_piece)
        assert summary(final.content) == expected, how
        assert final.stop_reason == ("tool_use" if any(t == "tool_use" for t, _ in expected) else "end_turn")
        events = [e for piece in per_piece for e in piece]
        starts = [e for e in events if e["type"] == "content_block_start"]
        assert [s["content_block"]["type"] for s in starts] == [t for t, _ in expected]
        assert all(s["content_block"]["input"] == {} and s["content_block"]["id"].startswith("toolu_")
                   for s in starts if s["content_block"]["type"] == "tool_use")
        for k, (kind, value) in enumerate(expected):
            deltas = [e["delta"] for e in events if e["type"] == "content_block_delta" and e["index"] == k]
            if kind == "tool_use":  # the fragments concatenate to the input's JSON
                assert "".join(d["partial_json"] for d in deltas) == json.dumps(value[1])
                assert len(deltas) > 1 or how == "whole", "the input streams as it is written"
            elif how == "chars":
                assert len(deltas) > 1, "text streams as it is written"


def test_text_before_a_call_is_not_held_back():
    text, _ = RECORDED[0]
    per_piece = stream_events(serving(), chat_request(tools=[WEATHER, TIME]), text, [1] * len(text))
    sent = ""
    for n, piece in enumerate(per_piece[1:], 1):
        sent += "".join(e["delta"].get("text", "") for e in piece if e["type"] == "content_block_delta")
        # what may still be a call's start (a prefix of <tool_call>) and trailing whitespace wait
        written = text[:n]
        if "<" not in written:
            assert sent == written.rstrip(), n
    assert sent == "Let me check both."


def test_a_call_cut_by_max_tokens_ends_the_stream_cleanly():
    """Streamed, a call broken after its arguments began keeps what was sent (valid JSON so far,
    read by the client's partial parser); the stream ends with message_stop, never an error."""
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    messages, chat_req = serving(), chat_request(tools=[WEATHER, TIME])
    events = messages.message_events(chat_req, None, 0)
    sent = [events.start("msg_1", "m", 7)]
    for n in range(1, len(text) + 1):
        sent += events.feed(output(text[:n], "length" if n == len(text) else None), 7)
    payloads = [read_event(e) for e in sent]
    assert payloads[-1]["type"] == "message_stop" and not any(p["type"] == "error" for p in payloads)
    assert payloads[-2]["delta"]["stop_reason"] == "max_tokens"
    final = final_message([payloads])
    assert summary(final.content)[0] == ("text", "Checking.") and final.content[1].name == "get_weather"
    # whole, the unfinished call is text
    assert summary(messages.reply_blocks(chat_req, output(text, "length"), None)) == [("text", text)]


def test_thinking_then_text_and_a_call():
    text = f"the user wants two things</think>\n\nOn it.\n{CALL_TIME}"
    messages, chat_req = serving("qwen3"), chat_request(tools=[WEATHER, TIME])
    expected = [("thinking", "the user wants two things"), ("text", "On it."),
                ("tool_use", ("get_time", {"zone": "Europe/Paris"}))]
    assert summary(messages.reply_blocks(chat_req, output(text, "stop"), ReplyStart.REASONING)) == expected
    for how in ("chars", "1"):
        per_piece = stream_events(messages, chat_req, text, pieces_of(text, how), ReplyStart.REASONING)
        assert summary(final_message(per_piece).content) == expected
        thinking = [e for piece in per_piece for e in piece
                    if e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta"]
        assert len(thinking) > 1


def test_forced_call_comes_whole_at_the_end():
    args = '{"zone": "CET"}'
    messages = serving()
    chat_req = chat_request(tools=[WEATHER, TIME], tool_choice={"type": "tool", "name": "get_time"})
    per_piece = stream_events(messages, chat_req, args, [1] * len(args))
    assert all(not piece for piece in per_piece[1:-1])  # (known once the reply is whole)
    final = final_message(per_piece)
    assert summary(final.content) == [("tool_use", ("get_time", {"zone": "CET"}))] and final.stop_reason == "tool_use"
    assert summary(final.content) == summary(messages.reply_blocks(chat_req, output(args, "stop"), None))


def test_content_blocks_keep_the_order_written():
    blocks = content_blocks(["  a \n", ("f", "{}"), "\n b\n", ("g", '{"x": 1}'), "  ", ("h", '{"cut": ')])
    assert [{k: v for k, v in b.items() if k != "id"} for b in blocks] == [
        {"type": "text", "text": "  a"}, {"type": "tool_use", "name": "f", "input": {}},
        {"type": "text", "text": "b"}, {"type": "tool_use", "name": "g", "input": {"x": 1}},
        {"type": "text", "text": '{"cut":'}]  # (arguments that are no JSON object: text)
    assert len({b["id"] for b in blocks if b["type"] == "tool_use"}) == 2
    assert content_blocks(["no calls  \n"]) == [{"type": "text", "text": "no calls  \n"}]
    assert [b["type"] for b in content_blocks(["  ", ("f", "{}"), " "])] == ["tool_use"]  # (whitespace: no block)

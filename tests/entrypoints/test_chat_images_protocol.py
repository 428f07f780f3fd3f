"""Images in chat and Responses requests, without an engine: content-part parsing, the messages
chat templates read, the 400s, and ``OpenAIServingChat.render`` turning a request into the engine's
prompt dict (a stub serving with the tiny LLaVA tokenizer)."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from halserve.entrypoints.openai.chat_protocol import ChatCompletionRequest, ChatContentPart
from halserve.entrypoints.openai.errors import BadRequestError, parse_body
from halserve.entrypoints.openai.responses_protocol import ResponsesRequest

RED = "data:image/png;base64,AAAA"  # (URLs are not loaded by the protocol models)


def _chat(*messages: dict, **fields) -> ChatCompletionRequest:
    return parse_body(ChatCompletionRequest, json.dumps({"messages": list(messages), **fields}).encode())


def _bad_chat(*messages: dict, **fields) -> BadRequestError:
    with pytest.raises(BadRequestError) as err:
        _chat(*messages, **fields)
    return err.value


def _user(*parts: dict) -> dict:
    return {"role": "user", "content": list(parts)}


def _image(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


# ---------------------------------------------------------------------- content parts
def test_content_part_shapes():
    assert ChatContentPart.model_validate({"type": "text", "text": "hi"}).url is None
    part = ChatContentPart.model_validate(_image("https://x/a.png", detail="low"))
    assert part.url == "https://x/a.png" and part.image_url.detail == "low"
    plain = ChatContentPart.model_validate({"type": "image_url", "image_url": "https://x/b.png"})  # (vLLM's)
    assert plain.url == "https://x/b.png" and plain.image_url.detail is None


@pytest.mark.parametrize("part, param, words", [
    ({"type": "input_audio", "input_audio": {}}, "messages[0].content[0]",
     "content parts of type 'input_audio' are not supported; only 'text' and 'image_url' parts are"),
    ({"type": "image_url"}, "messages[0].content[0]", "an 'image_url' content part needs an 'image_url' field"),
    ({"type": "image_url", "image_url": {"detail": "low"}}, "messages[0].content[0].image_url.url", "Field required"),
    ({"type": "image_url", "image_url": {"url": RED, "detail": "max"}}, "messages[0].content[0].image_url.detail",
     "'auto', 'low' or 'high'"),
    ({"type": "text"}, "messages[0].content[0]", "needs a 'text' field"),
])
def test_bad_content_parts(part, param, words):
    err = _bad_chat(_user(part))
    assert err.param == param and words in err.message, (err.param, err.message)
    assert "valid string" not in err.message  # (only the branch the content took is reported)


@pytest.mark.parametrize("role", ["system", "assistant", "developer", "tool"])
def test_images_only_in_user_messages(role):
    err = _bad_chat(_user({"type": "text", "text": "hi"}), {"role": role, "content": [_image(RED)]})
    assert err.param == "messages[1]"
    assert f"images are allowed in user messages only; this '{role}' message" in err.message


# ---------------------------------------------------------------------- template messages
def test_template_dict_with_images_keeps_the_order():
    req = _chat({"role": "system", "content": "be brief"},
                _user({"type": "text", "text": "compare "}, _image(RED), {"type": "text", "text": " with "},
                      {"type": "image_url", "image_url": "https://x/2.png"}))
    assert req.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "compare "}, {"type": "image"},
                                     {"type": "text", "text": " with "}, {"type": "image"}]},
    ]


def test_text_only_messages_keep_the_joined_string():
    req = _chat(_user({"type": "text", "text": "a"}, {"type": "text", "text": "b"}), {"role": "assistant",
                                                                                     "content": "c"})
    assert req.template_messages() == [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "c"}]
    assert req.image_urls() == [] and req.first_image_param() is None


def test_image_urls_in_message_order():
    req = _chat(_user(_image("https://x/1.png"), {"type": "text", "text": "and"}),
                {"role": "assistant", "content": "ok"},
                _user({"type": "text", "text": "then"}, _image("https://x/2.png"), _image("https://x/3.png")))
    assert req.image_urls() == ["https://x/1.png", "https://x/2.png", "https://x/3.png"]
    assert req.first_image_param() == "messages[0].content[0]"


# ---------------------------------------------------------------------- Responses
def _responses(**fields) -> ResponsesRequest:
    return parse_body(ResponsesRequest, json.dumps(fields).encode())


def test_input_image_maps_to_chat_image_parts():
    req = _responses(instructions="be brief", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "what is "},
                                     {"type": "input_image", "image_url": RED, "detail": "auto"}]},
        {"role": "assistant", "content": "a cat"},
        {"role": "user", "content": [{"type": "input_image", "image_url": "https://x/2.png"}]},
    ])
    assert req.first_image_param() == "input[0].content[1]"
    chat = req.chat_request()
    assert chat.image_urls() == [RED, "https://x/2.png"]
    assert chat.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "image"}]},
        {"role": "assistant", "content": "a cat"},
        {"role": "user", "content": [{"type": "image"}]},
    ]
    assert chat.messages[1].content[1].image_url.detail == "auto"


def test_responses_text_only_input_is_unchanged():
    req = _responses(input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}])
    assert req.first_image_param() is None
    assert req.chat_request().template_messages() == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("content, role, param, words", [
    ([{"type": "input_image", "file_id": "file_1"}], "user", "input[0].content[0]",
     "input_image parts with a file_id are not supported"),
    ([{"type": "input_image"}], "user", "input[0].content[0]", "needs an 'image_url'"),
    ([{"type": "input_file", "file_id": "file_1"}], "user", "input[0].content[0]", "'input_file' are not supported"),
    ([{"type": "input_image", "image_url": RED}], "system", "input[0]", "images are allowed in user messages only"),
])
def test_bad_responses_image_input(content, role, param, words):
    with pytest.raises(BadRequestError) as err:
        _responses(input=[{"role": role, "content": content}])
    assert err.value.param == param and words in err.value.message, (err.value.param, err.value.message)


# ---------------------------------------------------------------------- render (stub serving)
@pytest.fixture(scope="module")
def llava_tokenizer():
    from mm_factory import IMAGE_TOKEN, LLAVA_CHAT_TEMPLATE, VOCAB_SIZE
    from model_factory import make_tokenizer

    tokenizer = make_tokenizer(VOCAB_SIZE, 0, added_tokens=(IMAGE_TOKEN,))
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    return tokenizer


def _handler(tokenizer, is_multimodal: bool = True, media_dir: str | None = None, max_images: int = 64,
             domains: list[str] | None = None):
    from halserve.entrypoints.openai.serving_chat import OpenAIServingChat
    from halserve.entrypoints.openai.serving_engine import OpenAIServing

    info = SimpleNamespace(is_multimodal=is_multimodal, max_model_len=512, vocab_size=len(tokenizer),
                           max_images_per_prompt=max_images)
    engine = SimpleNamespace(tokenizer=tokenizer, tokenizer_pool=None, model_info=info)
    return OpenAIServingChat(OpenAIServing(engine, ["m"], "m", allowed_local_media_path=media_dir,
                                           allowed_media_domains=domains))


def test_render_sends_images_with_the_prompt(llava_tokenizer):
    from mm_factory import image_data_url, make_image

    url_1, url_2 = image_data_url(make_image(1)), image_data_url(make_image(2, size=(20, 20)))
    req = _chat(_user({"type": "text", "text": "look"}, _image(url_1), _image(url_2)))
    text, prompt = asyncio.run(_handler(llava_tokenizer).render(req))
    assert text.count("<image>") == 2 and text.index("look") < text.index("<image>")
    image_id = llava_tokenizer.convert_tokens_to_ids("<image>")
    assert prompt["prompt_token_ids"].count(image_id) == 2
    images = prompt["multi_modal_data"]["image"]
    assert [image.size for image in images] == [(40, 30), (20, 20)] and all(i.mode == "RGB" for i in images)
    # text only: the token ids, as before
    _, ids = asyncio.run(_handler(llava_tokenizer).render(_chat(_user({"type": "text", "text": "look"}))))
    assert isinstance(ids, list) and image_id not in ids


def test_render_errors(llava_tokenizer, tmp_path):
    handler = _handler(llava_tokenizer)
    req = _chat(_user({"type": "text", "text": "a"}, _image("data:image/png;base64,%%%")))
    with pytest.raises(BadRequestError) as err:
        asyncio.run(handler.render(req))
    assert err.value.param == "messages" and err.value.message.startswith("image 1 of 1: ")
    assert "base64" in err.value.message
    # file:// only with the server's --allowed-local-media-path
    from mm_factory import make_image

    make_image(3).save(tmp_path / "a.png")
    req = _chat(_user(_image((tmp_path / "a.png").as_uri())))
    with pytest.raises(BadRequestError, match="--allowed-local-media-path"):
        asyncio.run(handler.render(req))
    _, prompt = asyncio.run(_handler(llava_tokenizer, media_dir=str(tmp_path)).render(req))
    assert prompt["multi_modal_data"]["image"][0].size == (40, 30)
    # a text-only model: a 400 naming the part, before anything is fetched
    req = _chat(_user({"type": "text", "text": "a"}, _image("https://unreachable.invalid/x.png")))
    with pytest.raises(BadRequestError) as err:
        asyncio.run(_handler(llava_tokenizer, is_multimodal=False).render(req))
    assert err.value.param == "messages[0].content[1]" and "takes text only" in err.value.message
    # more images than --limit-mm-per-prompt: a 400 before any is fetched
    req = _chat(_user(_image("https://unreachable.invalid/x.png"), _image("https://unreachable.invalid/y.png")))
    with pytest.raises(BadRequestError, match="at most 1 images .*got 2"):
        asyncio.run(_handler(llava_tokenizer, max_images=1).render(req))
    # a host outside --allowed-media-domains: a 400, nothing fetched
    with pytest.raises(BadRequestError, match="image 1 of 2: image URLs may only name the hosts images.example"):
        asyncio.run(_handler(llava_tokenizer, domains=["images.example"]).render(req))


def test_beam_search_with_images_is_refused(llava_tokenizer):
    handler = _handler(llava_tokenizer)
    req = _chat(_user(_image(RED)), use_beam_search=True)
    with pytest.raises(BadRequestError) as err:
        asyncio.run(handler.create(req, raw_request=None))
    assert err.value.param == "use_beam_search" and "images" in err.value.message

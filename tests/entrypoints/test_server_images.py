"""Images over HTTP, end to end: ``halserve serve`` on the tiny LLaVA checkpoint (``mm_factory``) and the
official ``openai`` client. An image changes the greedy reply, the server's reply is ``LLM.chat``'s
offline, the Responses API's ``input_image`` is chat's ``image_url``, and bad images or a text-only
model are 400s that leave the server serving."""
from __future__ import annotations

import httpx
import openai
import pytest
from mm_factory import image_data_url, make_image, make_llava_checkpoint
from server_utils import SERVED_NAME, ServerProcess, server_args

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')

MAX_TOKENS = 8
QUESTION = "what is in the picture"


@pytest.fixture(scope="module")
def llava_checkpoint(tmp_path_factory) -> str:
    return make_llava_checkpoint(tmp_path_factory.mktemp("tiny_llava"))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("media")
    make_image(1).save(path / "one.png")
    return path


@pytest.fixture(scope="module")
def llava_server(llava_checkpoint, media_dir, tmp_path_factory):
    args = server_args(llava_checkpoint, "--allowed-local-media-path", str(media_dir))
    srv = ServerProcess(args, str(tmp_path_factory.mktemp("logs") / "llava.log"))
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def llava_client(llava_server):
    return openai.OpenAI(base_url=llava_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]}]


def _reply(client, url: str, **extra) -> str:
    out = client.chat.completions.create(model=SERVED_NAME, messages=_messages(url), max_tokens=MAX_TOKENS,
                                         temperature=0.0, **extra)
    return out.choices[0].message.content


def test_image_chat_returns_text(llava_client):
    out = llava_client.chat.completions.create(model=SERVED_NAME, messages=_messages(image_data_url(make_image(1))),
                                               max_tokens=MAX_TOKENS, temperature=0.0)
    assert out.choices[0].message.content and out.usage.completion_tokens == MAX_TOKENS
    text_only = llava_client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": QUESTION}], max_tokens=1)
    # (the image's one <image> placeholder became the model's 16 image tokens; "\n" follows it)
    assert out.usage.prompt_tokens - text_only.usage.prompt_tokens >= 16


def test_different_images_give_different_replies(llava_client):
    first, second = (_reply(llava_client, image_data_url(make_image(seed))) for seed in (1, 2))
    assert first != second
    assert _reply(llava_client, image_data_url(make_image(1))) == first  # (and the same image, the same one)


def test_server_matches_offline_chat(llava_client, llava_checkpoint, media_dir):
    from halserve.entrypoints.llm import LLM
    from halserve.sampling_params import SamplingParams

    url = image_data_url(make_image(3))
    served = _reply(llava_client, url)
    llm = LLM(llava_checkpoint, platform="cpu", max_model_len=128, num_kv_blocks=64,
              allowed_local_media_path=str(media_dir))
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    assert llm.chat(_messages(url), greedy, use_tqdm=False)[0].outputs[0].text == served
    # file:// URLs inside allowed_local_media_path, and bad images or roles: ValueErrors
    one = llm.chat(_messages((media_dir / "one.png").as_uri()), greedy, use_tqdm=False)[0].outputs[0].text
    assert one == _reply(llava_client, image_data_url(make_image(1)))
    with pytest.raises(ValueError, match="not valid base64"):
        llm.chat(_messages("data:image/png;base64,@@"), greedy, use_tqdm=False)
    with pytest.raises(ValueError, match="messages\\[0\\]: .*images are allowed in user messages only"):
        llm.chat([{**_messages(url)[0], "role": "system"}], greedy, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_file_url_stream_and_responses_agree(llava_client, media_dir):
    want = _reply(llava_client, image_data_url(make_image(1)))
    assert _reply(llava_client, (media_dir / "one.png").as_uri()) == want  # (--allowed-local-media-path)
    stream = llava_client.chat.completions.create(model=SERVED_NAME, messages=_messages(image_data_url(make_image(1))),
                                                  max_tokens=MAX_TOKENS, temperature=0.0, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == want
    response = llava_client.responses.create(
        model=SERVED_NAME, max_output_tokens=MAX_TOKENS, temperature=0.0,
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": image_data_url(make_image(1)),
                                             "detail": "auto"},
                                            {"type": "input_text", "text": QUESTION}]}])
    assert response.output_text == want


@pytest.mark.parametrize("url, words", [
    ("data:image/png;base64,@@not-base64@@", "base64"),
    ("data:image/png;base64,aGVsbG8gd29ybGQ=", "not an image"),
    ("file:///etc/passwd", "outside the allowed local media directory"),
    ("gopher://x/y.png", "scheme 'gopher'"),
])
def test_bad_image_is_400_and_the_server_carries_on(llava_server, llava_client, url, words):
    with pytest.raises(openai.BadRequestError) as err:
        _reply(llava_client, url)
    assert err.value.status_code == 400 and err.value.body["param"] == "messages"
    assert words in err.value.body["message"], err.value.body
    assert _reply(llava_client, image_data_url(make_image(1)))  # (the next request is served)
    assert httpx.get(llava_server.url + "/health").status_code == 200


def test_images_with_beam_search_are_400(llava_client):
    with pytest.raises(openai.BadRequestError) as err:
        _reply(llava_client, image_data_url(make_image(1)), extra_body={"use_beam_search": True})
    assert err.value.body["param"] == "use_beam_search"


def test_text_model_refuses_images(server, client):
    """(the session's text-only server: ``model_factory.make_checkpoint``)"""
    with pytest.raises(openai.BadRequestError) as err:
        _reply(client, image_data_url(make_image(1)))
    assert err.value.body["param"] == "messages[0].content[0]" and "takes text only" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=SERVED_NAME, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": image_data_url(make_image(1))}]}])
    assert err.value.body["param"] == "input[0].content[0]" and "input_image" in err.value.body["message"]
    assert client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2).choices[0].message.content is not None


def test_allowed_local_media_path_must_be_a_directory(llava_checkpoint, tmp_path, capsys):
    from halserve.entrypoints.cli import main

    missing = str(tmp_path / "nope")
    assert main(["serve", llava_checkpoint, "--platform", "cpu", "--allowed-local-media-path", missing]) == 2
    assert f"--allowed-local-media-path {missing}: no such directory" in capsys.readouterr().err


def test_qwen2_vl_chat_with_images_of_two_sizes(tmp_path_factory):
    """Qwen2-VL over HTTP: two images of different sizes (their own placeholder counts and M-RoPE
    positions) in one message; the reply equals ``LLM.chat``'s offline, streamed or not."""
    from mm_factory import make_qwen2_vl_checkpoint

    from halserve.entrypoints.llm import LLM
    from halserve.sampling_params import SamplingParams

    path = make_qwen2_vl_checkpoint(tmp_path_factory.mktemp("tiny_qwen2_vl"))
    parts = [{"type": "image_url", "image_url": {"url": image_data_url(make_image(5, size=(120, 70)))}},
             {"type": "text", "text": "and"},
             {"type": "image_url", "image_url": {"url": image_data_url(make_image(6, size=(50, 50)))}},
             {"type": "text", "text": QUESTION}]
    messages = [{"role": "user", "content": parts}]
    srv = ServerProcess(server_args(path), str(tmp_path_factory.mktemp("logs") / "qwen2_vl.log"))
    try:
        client = openai.OpenAI(base_url=srv.wait_ready().url + "/v1", api_key="unused", max_retries=0, timeout=120)
        served = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0.0)
        stream = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0.0, stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    finally:
        srv.stop()
    llm = LLM(path, platform="cpu", max_model_len=128, num_kv_blocks=64)
    try:
        offline = llm.chat(messages, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)[0]
    finally:
        llm.llm_engine.shutdown()
    assert served.choices[0].message.content == streamed == offline.outputs[0].text
    assert served.usage.prompt_tokens == len(offline.prompt_token_ids) > 20  # (the image tokens counted)

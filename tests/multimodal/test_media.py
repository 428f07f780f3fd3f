"""``halserve.multimodal.media.load_image``: data:, http(s): and file: URLs to RGB images, and every
way one can fail (a ValueError saying what was wrong). The http cases run against a local
``http.server`` in a thread."""
from __future__ import annotations

import asyncio
import base64
import io
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from halserve.multimodal.media import load_image, load_image_async


def _image(seed: int = 0, size: tuple[int, int] = (40, 30), mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}.get(mode)
    shape = (size[1], size[0], channels) if channels else (size[1], size[0])
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode)


def _encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _same(a: Image.Image, b: Image.Image) -> bool:
    return a.size == b.size and np.array_equal(np.asarray(a), np.asarray(b))


PNG = _encode(_image(1))


# ---------------------------------------------------------------------- data URLs
def test_data_url_png_round_trips():
    out = load_image(_data_url(PNG))
    assert out.mode == "RGB" and _same(out, _image(1))


def test_data_url_jpeg_and_grayscale_become_rgb():
    jpeg = load_image(_data_url(_encode(_image(2), "JPEG"), "image/jpeg"))
    assert jpeg.mode == "RGB" and jpeg.size == (40, 30)
    gray = load_image(_data_url(_encode(_image(3, mode="L"))))
    assert gray.mode == "RGB" and _same(gray, _image(3, mode="L").convert("RGB"))


def test_transparency_is_composited_on_white():
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 255))
    rgba.putpixel((0, 0), (0, 0, 0, 0))
    out = load_image(_data_url(_encode(rgba)))
    assert out.mode == "RGB"
    assert out.getpixel((0, 0)) == (255, 255, 255) and out.getpixel((1, 1)) == (10, 20, 30)


def test_data_url_base64_with_line_breaks_is_read():
    text = base64.b64encode(PNG).decode()
    wrapped = "\n".join(text[i : i + 76] for i in range(0, len(text), 76))
    assert _same(load_image(f"data:image/png;base64,{wrapped}"), _image(1))


@pytest.mark.parametrize("url, words", [
    ("data:image/png;base64,@@@not*base64@@@", "not valid base64"),
    ("data:image/png;base64,iVBORw0KGgo", "not valid base64"),  # (bad padding)
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
    ("data:;base64,aGVsbG8=", "not an image"),
    ("data:image/png,rawbytes", "only base64"),
    ("data:image/png;base64", "no ','"),
    ("data:image/png;base64," + base64.b64encode(b"hello, not a picture").decode(), "not an image PIL can read"),
    ("data:image/png;base64," + base64.b64encode(PNG[: len(PNG) // 2]).decode(), "truncated"),
])
def test_bad_data_urls(url, words):
    with pytest.raises(ValueError, match=words):
        load_image(url)


def test_decompression_bomb_is_an_error_not_a_warning(monkeypatch, recwarn):
    # 40x30 = 1200 pixels: past MAX_IMAGE_PIXELS (PIL would only warn) ...
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(ValueError, match="too large to decode safely.*1200 pixels"):
        load_image(_data_url(PNG))
    assert not [w for w in recwarn if issubclass(w.category, Image.DecompressionBombWarning)]
    # (decodes racing on the process-wide warning filter: the explicit size check still holds)
    monkeypatch.setattr(Image, "_decompression_bomb_check", lambda size: None)
    with pytest.raises(ValueError, match="1200 pixels, more than the 1000 allowed"):
        load_image(_data_url(PNG))
    monkeypatch.undo()
    # ... and past twice that (PIL's own DecompressionBombError)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500)
    with pytest.raises(ValueError, match="too large to decode safely"):
        load_image(_data_url(PNG))


@pytest.mark.parametrize("url, words", [
    ("ftp://example.com/a.png", "scheme 'ftp'"),
    ("picture.png", "no scheme"),
    ("", "non-empty string"),
    ("   ", "non-empty string"),
])
def test_unsupported_urls(url, words):
    with pytest.raises(ValueError, match=words) as err:
        load_image(url)
    assert "data:image/" in str(err.value)  # (says what works)


def test_data_url_over_the_size_cap(monkeypatch):
    monkeypatch.setenv("HALSERVE_MEDIA_MAX_BYTES", "100")
    with pytest.raises(ValueError, match="larger than the 100 bytes .*HALSERVE_MEDIA_MAX_BYTES"):
        load_image(_data_url(PNG))


@pytest.mark.parametrize("name", ["HALSERVE_MEDIA_MAX_BYTES", "HALSERVE_MEDIA_FETCH_TIMEOUT_S"])
def test_bad_settings_are_named(monkeypatch, name):
    monkeypatch.setenv(name, "lots")
    with pytest.raises(ValueError, match=f"{name}='lots' is not a positive number"):
        load_image("http://127.0.0.1:9/x.png" if "TIMEOUT" in name else _data_url(PNG))


# ---------------------------------------------------------------------- http(s)
class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # (quiet)
        pass

    def handle(self) -> None:
        try:
            super().handle()
        except (BrokenPipeError, ConnectionResetError):  # (the client gave up first: the error cases)
            pass

    def _send(self, status: int, body: bytes, length: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "image/png")
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/img.png":
            self._send(200, PNG, len(PNG))
        elif self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/img.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/redirect-away":  # the same server under another host name
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/img.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/slow.png":  # nothing for 3 s
            time.sleep(3)
            self._send(200, PNG, len(PNG))
        elif self.path == "/trickle.png":  # a byte every 0.1 s: each read is quick, the whole is not
            self._send(200, b"", len(PNG))
            for i in range(30):
                self.wfile.write(PNG[i : i + 1])
                self.wfile.flush()
                time.sleep(0.1)
        elif self.path == "/big-declared.png":
            self._send(200, PNG, len(PNG))
        elif self.path == "/big-undeclared.png":  # no Content-Length: the cap is checked as it streams
            self._send(200, PNG * 4)
        elif self.path == "/text":
            self._send(200, b"hello", 5)
        else:
            self._send(404, b"not found", 9)


@pytest.fixture(scope="module")
def http_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_http_image(http_url):
    assert _same(load_image(http_url + "/img.png"), _image(1))
    assert _same(load_image(http_url + "/redirect"), _image(1))


def test_allowed_media_domains(http_url):
    """--allowed-media-domains: only those hosts, redirects included."""
    assert _same(load_image(http_url + "/redirect", allowed_media_domains=["127.0.0.1"]), _image(1))
    assert _same(load_image(http_url + "/redirect-away"), _image(1))  # (any host without the list)
    with pytest.raises(ValueError, match=r"may only name the hosts images.example \(--allowed-media-domains\);"
                                         r" .* names '127.0.0.1'"):
        load_image(http_url + "/img.png", allowed_media_domains=["images.example"])
    with pytest.raises(ValueError, match="names 'localhost'"):
        load_image(http_url + "/redirect-away", allowed_media_domains=["127.0.0.1"])


def test_http_404(http_url):
    with pytest.raises(ValueError, match="HTTP 404 Not Found"):
        load_image(http_url + "/missing.png")


def test_http_not_an_image(http_url):
    with pytest.raises(ValueError, match="not an image PIL can read"):
        load_image(http_url + "/text")


def test_http_timeout(http_url, monkeypatch):
    start = time.monotonic()
    with pytest.raises(ValueError, match="timed out after 0.5 s"):
        load_image(http_url + "/slow.png", timeout=0.5)
    with pytest.raises(ValueError, match="timed out after 0.5 s"):  # (the whole download is timed)
        load_image(http_url + "/trickle.png", timeout=0.5)
    monkeypatch.setenv("HALSERVE_MEDIA_FETCH_TIMEOUT_S", "0.4")
    with pytest.raises(ValueError, match="timed out after 0.4 s .*HALSERVE_MEDIA_FETCH_TIMEOUT_S"):
        load_image(http_url + "/slow.png")
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("path", ["/big-declared.png", "/big-undeclared.png"])
def test_http_too_large(http_url, monkeypatch, path):
    monkeypatch.setenv("HALSERVE_MEDIA_MAX_BYTES", str(len(PNG) * 2 if "undeclared" in path else len(PNG) - 1))
    with pytest.raises(ValueError, match="is larger than the .* bytes an image may have"):
        load_image(http_url + path)


def test_http_connection_refused():
    from server_utils import free_port

    with pytest.raises(ValueError, match="fetching the image .* failed: ConnectError"):
        load_image(f"http://127.0.0.1:{free_port()}/img.png")


def test_async_loader(http_url):
    async def both():
        return await asyncio.gather(load_image_async(http_url + "/img.png"), load_image_async(_data_url(PNG)))

    assert all(_same(image, _image(1)) for image in asyncio.run(both()))


# ---------------------------------------------------------------------- file://
@pytest.fixture
def media_dir(tmp_path):
    allowed = tmp_path / "media"
    (allowed / "sub").mkdir(parents=True)
    (allowed / "sub" / "img.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    os.symlink(tmp_path / "secret.png", allowed / "link.png")
    return allowed


def test_file_url_inside_the_allowed_dir(media_dir):
    url = (media_dir / "sub" / "img.png").as_uri()
    assert _same(load_image(url, allowed_local_media_path=str(media_dir)), _image(1))


def test_file_urls_need_the_flag(media_dir):
    with pytest.raises(ValueError, match="--allowed-local-media-path"):
        load_image((media_dir / "sub" / "img.png").as_uri())


@pytest.mark.parametrize("name", ["../secret.png", "link.png", "sub/../../secret.png"])
def test_file_urls_outside_the_allowed_dir(media_dir, name):
    url = f"file://{media_dir}/{name}"
    with pytest.raises(ValueError, match="outside the allowed local media directory"):
        load_image(url, allowed_local_media_path=str(media_dir))


def test_file_url_errors(media_dir, monkeypatch):
    with pytest.raises(ValueError, match="no such file"):
        load_image(f"file://{media_dir}/nope.png", allowed_local_media_path=str(media_dir))
    with pytest.raises(ValueError, match="not host 'example.com'"):
        load_image(f"file://example.com{media_dir}/sub/img.png", allowed_local_media_path=str(media_dir))
    monkeypatch.setenv("HALSERVE_MEDIA_MAX_BYTES", "10")
    with pytest.raises(ValueError, match="is larger than the 10 bytes"):
        load_image(f"file://{media_dir}/sub/img.png", allowed_local_media_path=str(media_dir))

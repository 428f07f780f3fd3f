"""Images named by URL, as the OpenAI API sends them (vLLM's ``MediaConnector`` rules):

    data:image/png;base64,iVBOR...   decoded in place
    http://... / https://...         fetched with httpx (HALSERVE_MEDIA_FETCH_TIMEOUT_S, default 10 s, for
                                     the whole download; at most HALSERVE_MEDIA_MAX_BYTES, default 20 MiB,
                                     checked as the body streams in)
    file:///abs/path.png             only below ``allowed_local_media_path`` (``--allowed-local-media-path``)

``allowed_media_domains`` (``--allowed-media-domains``, vLLM's): when given, http(s) URLs, and every
redirect they lead to, must name one of these hosts (a server reachable from inside a network should
not fetch whatever URL a client names).

Every image is decoded with PIL and returned in RGB (transparent parts on white). An image of more
than ``PIL.Image.MAX_IMAGE_PIXELS`` pixels is refused (PIL itself only warns below twice that: a
decompression bomb). Every failure is a ``ValueError`` that says what was wrong and how to fix it:
the server turns it into a 400.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse
from urllib.request import url2pathname

if TYPE_CHECKING:  # pragma: no cover
    from PIL import Image

__all__ = ["decode_image", "fetch_timeout_s", "load_image", "load_image_async", "max_media_bytes"]

DEFAULT_FETCH_TIMEOUT_S = 10.0
DEFAULT_MAX_BYTES = 20 * 2**20
_SCHEMES = "data:image/...;base64,..., http(s):// or file:// (with --allowed-local-media-path)"


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{name}={raw!r} is not a positive number; fix or unset it (default {default:g})")
    return value


def fetch_timeout_s() -> float:
    """Seconds an http(s) image may take to download (``HALSERVE_MEDIA_FETCH_TIMEOUT_S``)."""
    return _env_number("HALSERVE_MEDIA_FETCH_TIMEOUT_S", DEFAULT_FETCH_TIMEOUT_S)


def max_media_bytes() -> int:
    """The largest encoded image accepted, in bytes (``HALSERVE_MEDIA_MAX_BYTES``)."""
    return int(_env_number("HALSERVE_MEDIA_MAX_BYTES", DEFAULT_MAX_BYTES))


def _short(url: str, limit: int = 80) -> str:
    return url if len(url) <= limit else url[: limit - 3] + "..."


def _too_large(size: int | None, limit: int, what: str) -> ValueError:
    got = f" ({size} bytes)" if size is not None else ""
    return ValueError(f"{what}{got} is larger than the {limit} bytes an image may have "
                      "(HALSERVE_MEDIA_MAX_BYTES); send a smaller or more compressed image")


# ---------------------------------------------------------------------- sources
def _data_url_bytes(url: str, limit: int) -> bytes:
    """``data:image/png;base64,....`` -> the encoded image."""
    header, sep, payload = url[len("data:"):].partition(",")
    if not sep:
        raise ValueError("the data URL has no ',' before its payload; use data:image/png;base64,<base64 data>")
    media_type, _, encoding = header.partition(";")
    if not media_type.lower().startswith("image/"):
        raise ValueError(f"the data URL's media type is {media_type or 'missing'!r}, not an image; "
                         "use data:image/png;base64,... (or image/jpeg, image/webp, ...)")
    if encoding.lower() != "base64":
        raise ValueError(f"only base64 data URLs are supported (data:{media_type};base64,...), "
                         f"got data:{header}")
    payload = "".join(payload.split())  # (line breaks some encoders insert)
    if len(payload) * 3 // 4 > limit:
        raise _too_large(len(payload) * 3 // 4, limit, "the data URL's image")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"the data URL's payload is not valid base64 ({exc}); encode the image bytes with "
                         "standard base64 (RFC 4648, '+/' alphabet, '=' padding)") from None


def _check_domain(url: str, allowed_media_domains: Sequence[str] | None) -> None:
    if allowed_media_domains is None:
        return
    host = (urlparse(url).hostname or "").lower()
    if host not in {d.lower() for d in allowed_media_domains}:
        raise ValueError(f"image URLs may only name the hosts {', '.join(allowed_media_domains)} "
                         f"(--allowed-media-domains); {_short(url)} names {host or 'no host'!r}")


def _http_bytes(url: str, timeout: float, limit: int, allowed_media_domains: Sequence[str] | None = None) -> bytes:
    """The body of a GET of ``url``: within ``timeout`` seconds all told, at most ``limit`` bytes; with
    ``allowed_media_domains``, only from those hosts (redirects included)."""
    try:
        import httpx
    except ImportError:  # pragma: no cover - httpx comes with the server's dependencies
        raise ValueError("fetching images over http(s) needs the httpx package (pip install httpx); "
                         "or send the image as a data URL") from None
    deadline = time.monotonic() + timeout
    shown = _short(url)
    _check_domain(url, allowed_media_domains)
    refused: list[ValueError] = []

    def check_hop(request) -> None:  # (each request, redirects included, before it is sent)
        try:
            _check_domain(str(request.url), allowed_media_domains)
        except ValueError as exc:
            refused.append(exc)
            raise httpx.UnsupportedProtocol("refused host") from None

    try:
        with httpx.Client(timeout=timeout, follow_redirects=True, event_hooks={"request": [check_hop]}) as client:
            with client.stream("GET", url) as response:
                if response.status_code >= 400:
                    raise ValueError(f"fetching the image {shown} failed: HTTP {response.status_code} "
                                     f"{response.reason_phrase}; check that the URL is right and public")
                declared = response.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > limit:
                    raise _too_large(int(declared), limit, f"the image at {shown}")
                body = bytearray()
                for chunk in response.iter_bytes():
                    body += chunk
                    if len(body) > limit:
                        raise _too_large(None, limit, f"the image at {shown}")
                    if time.monotonic() > deadline:
                        raise httpx.ReadTimeout("the download did not finish in time")
                return bytes(body)
    except httpx.TimeoutException:
        raise ValueError(f"fetching the image {shown} timed out after {timeout:g} s "
                         "(HALSERVE_MEDIA_FETCH_TIMEOUT_S); use a faster host or send it as a data URL") from None
    except httpx.HTTPError as exc:  # (connection refused, DNS failure, bad URL, too many redirects, ...)
        if refused:
            raise refused[0] from None
        raise ValueError(f"fetching the image {shown} failed: {type(exc).__name__}: {exc}; check the URL, or send "
                         "the image as a data URL") from None


def _file_bytes(url: str, allowed_local_media_path: str | None, limit: int) -> bytes:
    """A ``file://`` URL's file, if it lies inside ``allowed_local_media_path``."""
    if allowed_local_media_path is None:
        raise ValueError("file:// image URLs are refused unless the server is started with "
                         "--allowed-local-media-path DIR (and the file is inside DIR); send the image as a data URL")
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"file:// URLs name a local file (file:///abs/path.png), not host {parsed.netloc!r}")
    path = Path(url2pathname(unquote(parsed.path)))
    allowed = Path(allowed_local_media_path).resolve()
    resolved = path.resolve()  # (symlinks and '..' followed before the check)
    if not resolved.is_relative_to(allowed):
        raise ValueError(f"the file {str(path)!r} is outside the allowed local media directory {str(allowed)!r} "
                         "(--allowed-local-media-path); only files inside it can be read")
    if not resolved.is_file():
        raise ValueError(f"no such file: {str(path)!r} (file:// URLs need an absolute path to an existing file)")
    size = resolved.stat().st_size
    if size > limit:
        raise _too_large(size, limit, f"the file {str(path)!r}")
    return resolved.read_bytes()


# ---------------------------------------------------------------------- decoding
def decode_image(data: bytes) -> Image.Image:
    """Encoded bytes -> an RGB image; ValueError when they are not a (reasonable) image."""
    from PIL import Image, UnidentifiedImageError

    try:
        # PIL only warns between MAX_IMAGE_PIXELS and twice that: here it is an error. (The filter is
        # process-wide while it is set, so a concurrent decode may miss it: the size check below holds.)
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ValueError(f"the image is too large to decode safely ({exc}); send a smaller image") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ValueError(f"the data is not an image PIL can read ({type(exc).__name__}: {exc}); "
                         "send a PNG, JPEG, WebP or GIF") from None
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and image.width * image.height > limit:
        raise ValueError(f"the image is {image.width}x{image.height} = {image.width * image.height} pixels, more "
                         f"than the {limit} allowed (a decompression bomb?); send a smaller image")
    try:
        image.load()
    except Exception as exc:  # noqa: BLE001 - truncated or corrupt data: PIL raises many kinds
        raise ValueError(f"the image could not be decoded ({type(exc).__name__}: {exc}); it may be truncated "
                         "or corrupt") from None
    return _to_rgb(image)


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white (as vLLM's ``convert_image_mode``)."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")


# ---------------------------------------------------------------------- entry points
def load_image(url: str, *, allowed_local_media_path: str | None = None, timeout: float | None = None,
               allowed_media_domains: Sequence[str] | None = None) -> Image.Image:
    """The RGB image ``url`` names (a data:, http(s): or file: URL). ``timeout``: seconds for an
    http(s) download (None: ``HALSERVE_MEDIA_FETCH_TIMEOUT_S``, default 10); ``allowed_media_domains``:
    the hosts http(s) URLs may name (None: any). ValueError on any failure."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"an image URL must be a non-empty string, got {url!r:.40}; use {_SCHEMES}")
    url = url.strip()
    limit = max_media_bytes()
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_url_bytes(url, limit)
    elif scheme in ("http", "https"):
        data = _http_bytes(url, fetch_timeout_s() if timeout is None else timeout, limit, allowed_media_domains)
    elif scheme == "file":
        data = _file_bytes(url, allowed_local_media_path, limit)
    else:
        what = f"scheme {scheme!r}" if scheme else "no scheme"
        raise ValueError(f"the image URL {_short(url, 60)!r} has {what}; image URLs must be {_SCHEMES}")
    return decode_image(data)


async def load_image_async(url: str, *, allowed_local_media_path: str | None = None, timeout: float | None = None,
                           allowed_media_domains: Sequence[str] | None = None) -> Image.Image:
    """``load_image`` in a worker thread (downloads and decoding keep the event loop free)."""
    return await asyncio.to_thread(load_image, url, allowed_local_media_path=allowed_local_media_path,
                                   timeout=timeout, allowed_media_domains=allowed_media_domains)

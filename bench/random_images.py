"""Seeded random images for ``halserve bench serve --random-images N`` (vLLM's ``random-mm`` dataset):
RGB noise of ``--random-image-size`` sides, sent as ``data:image/png;base64,...`` URLs in chat
``image_url`` parts.

Request ``i``'s images come from ``numpy.random.default_rng([seed, 0, i])``, so they depend only on
the seed and the index (not on ``--num-prompts``); the test request's come from ``[seed, 1]``, so
they differ from every timed one (a server's image cache must not serve a timed request).
"""
from __future__ import annotations

import argparse
import base64
import io
import re
from dataclasses import dataclass

__all__ = ["ImageSize", "parse_image_size", "random_image_urls", "warmup_image_urls"]


@dataclass(frozen=True, slots=True)
class ImageSize:
    """Width and height ranges in pixels, both ends included; each side drawn uniformly."""

    min_width: int
    max_width: int
    min_height: int
    max_height: int

    def __str__(self) -> str:
        def side(low: int, high: int) -> str:
            return str(low) if low == high else f"{low}-{high}"

        return f"{side(self.min_width, self.max_width)}x{side(self.min_height, self.max_height)}"


_SIDE = r"(\d+)(?:-(\d+))?"


def parse_image_size(spec: str) -> ImageSize:
    """``"224x224"`` (fixed), ``"200-400"`` (both sides in 200..400), ``"200-400x100-200"`` or ``"64"``.
    An argparse ``type``: a bad spec is an ``ArgumentTypeError`` (usage error, exit 2)."""
    match = re.fullmatch(rf"{_SIDE}(?:x{_SIDE})?", spec.strip().lower())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"invalid image size {spec!r}: use WxH (e.g. 224x224), a range of sides LOW-HIGH (e.g. 200-400) "
            "or WLOW-WHIGHxHLOW-HHIGH")
    w_low, w_high, h_low, h_high = match.groups()
    w_high = w_high or w_low
    h_low, h_high = (h_low, h_high or h_low) if h_low is not None else (w_low, w_high)
    size = ImageSize(int(w_low), int(w_high), int(h_low), int(h_high))
    if min(size.min_width, size.min_height) < 1 or size.min_width > size.max_width or size.min_height > size.max_height:
        raise argparse.ArgumentTypeError(
            f"invalid image size {spec!r}: sides must be >= 1 and each range LOW-HIGH must have LOW <= HIGH")
    return size


def _png_data_url(rng, size: ImageSize) -> str:
    import numpy as np
    from PIL import Image

    width = int(rng.integers(size.min_width, size.max_width + 1))
    height = int(rng.integers(size.min_height, size.max_height + 1))
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    # (noise does not compress: level 1 spends the least time trying)
    Image.fromarray(pixels, "RGB").save(buf, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _urls(entropy: list[int], num_images: int, size: ImageSize) -> list[str]:
    import numpy as np

    rng = np.random.default_rng(entropy)
    return [_png_data_url(rng, size) for _ in range(num_images)]


def random_image_urls(num_prompts: int, num_images: int, size: ImageSize, seed: int) -> list[list[str]]:
    """``num_images`` PNG data URLs for each of ``num_prompts`` requests (``[]`` each when 0)."""
    return [_urls([seed, 0, i], num_images, size) for i in range(num_prompts)]


def warmup_image_urls(num_images: int, size: ImageSize, seed: int) -> list[str]:
    """The test request's images: drawn apart from every timed request's."""
    return _urls([seed, 1], num_images, size)

"""LLaVA-NeXT (llava-v1.6): LLaVA (``llava.py``: CLIP tower, projector, Llama-family decoder) on images
of any resolution ("anyres"), cut into tiles of the tower's size S.

    image (height h, width w)
      the image processor picks the grid (bh, bw) in image_grid_pinpoints that keeps the most of the
      image (select_best_resolution), resizes the image into it keeping the aspect ratio, pads it, cuts
      it into (bh / S) x (bw / S) grid tiles and adds the whole image resized to S x S (the base tile)
      pixel_values [1 + gh * gw, 3, S, S] (base first, then the grid row by row), image_sizes [2] = (h, w)
      tower + feature layer(s) + strategy "default" + projector, per tile      [1 + gh * gw, p * p, H]
      pack:  the base tile's p * p rows, then the grid tiles' features laid out as one
             (gh * p) x (gw * p) map, "unpadded" (the rows or columns that cover the processor's padding
             cut off, so the map has the image's aspect ratio), row by row, each row followed by the
             learned ``image_newline`` vector                                  [num_image_tokens, H]

    p = S / patch_size; num_image_tokens = p * p + rows * cols + rows (rows x cols: the unpadded map)

The prompt holds a run of ``num_image_tokens`` ``<image>`` tokens per image (``LlavaNextProcessor`` writes
them); ``num_image_tokens`` computes it from the image's ``image_sizes`` and the config alone.

Checkpoint names: LLaVA's two schemes (``llava.py``), plus the newline vector:

    llava-hf on the Hub, transformers' save         newer
    image_newline                                   model.image_newline
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from halserve.distributed import get_pp_state
from halserve.layers import ModelContext
from halserve.models.llava import LlavaForConditionalGeneration, _select_strategy
from halserve.models.pipeline import PPMissingLayer


def select_best_resolution(image_size: tuple[int, int], pinpoints: list[tuple[int, int]]) -> tuple[int, int]:
    """The (height, width) in ``pinpoints`` that an image of ``image_size`` (height, width), scaled to fit
    it keeping its aspect ratio, fills with the most of its own pixels (never more than it has: no credit
    for upscaling); ties go to the least padding, then to the earlier pinpoint."""
    height, width = image_size
    best, best_effective, best_wasted = None, 0, float("inf")
    for pin_height, pin_width in pinpoints:
        scale = min(pin_width / width, pin_height / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = pin_width * pin_height - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (pin_height, pin_width), effective, wasted
    assert best is not None, "no pinpoints"
    return best


def grid_shape(hf_config: Any, image_size: tuple[int, int]) -> tuple[int, int]:
    """(rows, columns) of grid tiles of an image of ``image_size`` (height, width)."""
    tile = hf_config.vision_config.image_size
    pinpoints = getattr(hf_config, "image_grid_pinpoints", None)
    if not pinpoints:
        raise ValueError("the LLaVA-NeXT config has no image_grid_pinpoints; add the checkpoint's list of "
                         "[height, width] resolutions")
    pinpoints = [(int(h), int(w)) for h, w in pinpoints]
    bad = [list(p) for p in pinpoints if p[0] % tile or p[1] % tile or min(p) <= 0]
    if bad:
        raise ValueError(f"image_grid_pinpoints {bad} are not positive multiples of the vision tower's "
                         f"image_size {tile}")
    height, width = image_size
    if height <= 0 or width <= 0:
        raise ValueError(f"image_sizes {[height, width]} is not a (height, width) of pixels")
    best_height, best_width = select_best_resolution((height, width), pinpoints)
    return best_height // tile, best_width // tile


def unpadded_slices(image_size: tuple[int, int], rows: int, cols: int) -> tuple[slice, slice]:
    """The part of a rows x cols feature map (the padded grid) that covers an image of ``image_size``
    (height, width): the processor centred the image and padded the other axis evenly."""
    height, width = image_size
    if width / height > cols / rows:  # wider than the map: padding above and below
        new_rows = int(round(height * (cols / width), 7))
        pad = (rows - new_rows) // 2
        return slice(pad, rows - pad), slice(0, cols)
    new_cols = int(round(width * (rows / height), 7))
    pad = (cols - new_cols) // 2
    return slice(0, rows), slice(pad, cols - pad)


def _image_size(image_inputs: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    size = image_inputs.get("image_sizes")
    if size is None or torch.as_tensor(size).numel() != 2:
        raise ValueError(f"LLaVA-NeXT image inputs need image_sizes [2] (height, width), got {size!r}")
    height, width = (int(x) for x in torch.as_tensor(size).reshape(2).tolist())
    return height, width


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA's model protocol (``llava.py``), with per-image token counts:

    split_image_inputs(hf_config, processed, num_images) -> per image ``pixel_values`` [tiles_i, 3, S, S]
        (its real tiles, base first) and ``image_sizes`` [2] (class method)
    num_image_tokens(hf_config, image_inputs) -> that image's placeholder tokens (class method)
    embed_multimodal(items) -> [num_image_tokens_i, H] per item: all items' tiles through the tower in
        one call, then packed per image (first pipeline stage)
    embed_images(pixel_values [N, 3, S, S]) -> [N, p * p, H]: each tile's projected features, unpacked
    """

    CHECKPOINT_RENAMES = [("model.image_newline", "image_newline"), *LlavaForConditionalGeneration.CHECKPOINT_RENAMES]
    VISION_PREFIXES = (*LlavaForConditionalGeneration.VISION_PREFIXES, "image_newline")

    def __init__(self, hf_config: Any, ctx: ModelContext) -> None:
        _check_strategy(hf_config)
        super().__init__(hf_config, ctx)
        if get_pp_state().is_first:
            hidden = hf_config.text_config.hidden_size
            self.image_newline = nn.Parameter(torch.empty(hidden, dtype=ctx.dtype), requires_grad=False)
        else:
            self.image_newline = PPMissingLayer()

    # -- multimodal inputs (class methods: the processor side calls them without a model) -----
    @classmethod
    def split_image_inputs(cls, hf_config: Any, processed: Mapping[str, torch.Tensor],
                           num_images: int) -> list[dict[str, torch.Tensor]]:
        """The image processor's ``pixel_values`` [N, max tiles, 3, S, S] (padded with zero tiles) and
        ``image_sizes`` [N, 2] -> each image's real tiles [tiles_i, 3, S, S] and its ``image_sizes`` [2]."""
        pixel_values, image_sizes = processed.get("pixel_values"), processed.get("image_sizes")
        if pixel_values is None or image_sizes is None:
            raise ValueError(f"the image processor's output has {sorted(processed)}; {cls.__name__} needs "
                             "pixel_values and image_sizes (a LLaVA-NeXT image processor's)")
        if pixel_values.dim() != 5 or pixel_values.shape[0] != num_images:
            raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}, expected ({num_images}, tiles, "
                             "3, S, S); use the checkpoint's LlavaNextImageProcessor with do_pad=True")
        if tuple(image_sizes.shape) != (num_images, 2):
            raise ValueError(f"image_sizes has shape {tuple(image_sizes.shape)}, expected ({num_images}, 2)")
        items = []
        for pixels, size in zip(pixel_values, image_sizes):
            rows, cols = grid_shape(hf_config, _image_size({"image_sizes": size}))
            num_tiles = 1 + rows * cols
            if num_tiles > pixels.shape[0]:
                raise ValueError(f"an image of size {size.tolist()} needs {num_tiles} tiles, pixel_values has "
                                 f"{pixels.shape[0]}; do the processor's and the config's image_grid_pinpoints agree?")
            items.append({"pixel_values": pixels[:num_tiles], "image_sizes": size})
        return items

    @classmethod
    def num_image_tokens(cls, hf_config: Any, image_inputs: Mapping[str, torch.Tensor] | None = None) -> int:
        """Placeholder tokens of one image (module docstring): the base tile's p * p, then the unpadded
        grid map's rows x cols plus one newline per row."""
        if image_inputs is None:
            raise ValueError(f"{cls.__name__}.num_image_tokens needs the image's inputs (its image_sizes): "
                             "images of different sizes have different token counts")
        _check_strategy(hf_config)
        image_size = _image_size(image_inputs)
        p = hf_config.vision_config.image_size // hf_config.vision_config.patch_size
        grid_rows, grid_cols = grid_shape(hf_config, image_size)
        rows, cols = unpadded_slices(image_size, grid_rows * p, grid_cols * p)
        num_rows, num_cols = rows.stop - rows.start, cols.stop - cols.start
        return p * p + num_rows * num_cols + num_rows

    # -- model -----------------------------------------------------------------------------
    def embed_multimodal(self, items: list[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
        """``split_image_inputs`` items -> the rows [num_image_tokens_i, H] that replace each image's
        placeholders (first pipeline stage). Every tile of every item goes through the tower in one call."""
        if not items:
            return []
        sizes = [_image_size(item) for item in items]
        grids = [grid_shape(self.config, size) for size in sizes]
        for item, (rows, cols) in zip(items, grids):
            if item["pixel_values"].shape[0] != 1 + rows * cols:
                raise ValueError(f"an image of size {list(_image_size(item))} has {item['pixel_values'].shape[0]} "
                                 f"tiles, expected {1 + rows * cols} (1 + a {rows}x{cols} grid)")
        device = self.multi_modal_projector.linear_1.weight.device
        tiles = torch.cat([item["pixel_values"] for item in items]).to(device)  # [sum of tiles, 3, S, S]
        features = self.embed_images(tiles)  # [sum of tiles, p * p, H]
        per_image = features.split([1 + rows * cols for rows, cols in grids])
        return [self._pack(f, size, grid) for f, size, grid in zip(per_image, sizes, grids)]

    def _pack(self, features: torch.Tensor, image_size: tuple[int, int], grid: tuple[int, int]) -> torch.Tensor:
        """One image's tile features [1 + gh * gw, p * p, H] -> its rows [num_image_tokens, H]."""
        (grid_rows, grid_cols), hidden = grid, features.shape[-1]
        p = self.config.vision_config.image_size // self.config.vision_config.patch_size
        base, tiles = features[0], features[1:]  # [p * p, H], [gh * gw, p * p, H]
        # tile (i, j)'s patch (r, c) -> map row i * p + r, column j * p + c
        feature_map = (tiles.view(grid_rows, grid_cols, p, p, hidden).permute(0, 2, 1, 3, 4)
                       .reshape(grid_rows * p, grid_cols * p, hidden))
        rows, cols = unpadded_slices(image_size, grid_rows * p, grid_cols * p)
        feature_map = feature_map[rows, cols]  # [rows, cols, H]
        newline = self.image_newline.to(feature_map.dtype).expand(feature_map.shape[0], 1, hidden)
        return torch.cat([base, torch.cat([feature_map, newline], dim=1).reshape(-1, hidden)])

    def _load_vision_weight(self, name: str, original: str, tensor: torch.Tensor) -> set[str]:
        if not name.startswith("image_newline"):
            return super()._load_vision_weight(name, original, tensor)
        if name != "image_newline":
            raise ValueError(f"checkpoint tensor {original!r} has no matching parameter in {type(self).__name__}")
        if tuple(tensor.shape) != tuple(self.image_newline.shape):
            raise ValueError(f"checkpoint tensor {original!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(self.image_newline.shape)}")
        self.image_newline.data.copy_(tensor)
        return {name}


def _check_strategy(hf_config: Any) -> None:
    """Only "default" (the CLS token dropped): the grid tiles' features must be p x p maps."""
    strategy = _select_strategy(hf_config)
    if strategy != "default":
        raise ValueError(f"LLaVA-NeXT with vision_feature_select_strategy {strategy!r} is not supported (its tiles' "
                         "features must be square patch maps); use 'default'")

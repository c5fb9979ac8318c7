"""Mistral 3 (Pixtral encoder): an image keeps its aspect ratio, shrunk so its longest edge fits
(1024 px), each side rounded up to whole patch x merge units (transformers' PixtralImageProcessor
as Mistral3's processor calls it). The chat template's [IMG] becomes one [IMG] per merged unit,
row by row, each row closed by [IMG_BREAK], the last by [IMG_END]."""
from __future__ import annotations

import math

import numpy as np
from PIL import Image

from xinfer.ipc.media import ImageData
from xinfer.mm.base import (
    MEAN_CLIP,
    STD_CLIP,
    ImageProcessor,
    PromptImageError,
    content_hash,
    normalised,
    to_rgb,
)


def resized_size(height: int, width: int, longest: int, unit: int) -> tuple[int, int]:
    ratio = max(height / longest, width / longest)
    if ratio > 1:
        height, width = math.floor(height / ratio), math.floor(width / ratio)
    return ((height - 1) // unit + 1) * unit, ((width - 1) // unit + 1) * unit


class PixtralProcessor(ImageProcessor):
    def __init__(self, cfg: dict, tok=None):
        super().__init__(cfg, tok)
        v, p = self.mm["vision_config"], self.pre
        self.patch = v.get("patch_size", 14)
        self.merge = self.mm.get("spatial_merge_size", 1)
        size = p.get("size") or {}
        self.longest = size.get("longest_edge") or v.get("image_size", 1024)
        self.mean = p.get("image_mean") or MEAN_CLIP
        self.std = p.get("image_std") or STD_CLIP
        self.scale = p.get("rescale_factor") or 1 / 255
        self.placeholder_id = self.mm.get("image_token_index", self.mm.get("image_token_id", 10))
        ids = {} if tok is None else tok.tok.get_vocab(with_added_tokens=True)
        self.break_id, self.end_id = ids.get("[IMG_BREAK]"), ids.get("[IMG_END]")

    def prepare(self, img) -> ImageData:
        rgb = to_rgb(img)
        w, h = rgb.size
        unit = self.patch * self.merge
        rh, rw = resized_size(h, w, self.longest, unit)
        pixels = np.asarray(rgb.resize((rw, rh), resample=Image.Resampling.BICUBIC), dtype=np.uint8).tobytes()
        rows, cols = rh // unit, rw // unit
        return ImageData(content_hash(pixels, rh, rw), 0, rows * (cols + 1), rh, rw, pixels,
                         (1, rh // self.patch, rw // self.patch))

    def replacement(self, im: ImageData) -> tuple[list[int], int]:
        """The embeddings span every token of it: the model writes the break and end tokens' own."""
        if self.break_id is None or self.end_id is None:
            raise PromptImageError("this Mistral 3 tokenizer lacks the [IMG_BREAK] / [IMG_END] tokens")
        _, gh, gw = im.grid
        cols = gw // self.merge
        toks = ([self.placeholder_id] * cols + [self.break_id]) * (gh // self.merge)
        toks[-1] = self.end_id
        return toks, 0

    def pixel_values(self, im: ImageData) -> np.ndarray:
        """float32 [3, height, width], as transformers' pixel_values of one image (unpadded)."""
        return normalised(im, self.mean, self.std, self.scale)

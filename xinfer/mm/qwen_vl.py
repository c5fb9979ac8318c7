"""Qwen3-VL (dense and MoE): dynamic resolution. Each image is resized so both sides are multiples
of patch x merge pixels and its area stays within [min_pixels, max_pixels] (smart resize), cut
into patch x patch squares (each twice, the temporal patch), and every merge x merge block of
patches is one token of the language model. Positions are M-RoPE: three rows (time, height,
width); an image's tokens sit on its grid, the text after it goes on from the grid's far side."""
from __future__ import annotations

import math

import numpy as np
from PIL import Image

from xinfer.ipc.media import ImageData
from xinfer.mm.base import (
    MEAN_CLIP,
    STD_CLIP,
    ImageProcessor,
    content_hash,
    normalised,
    to_rgb,
)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"an image's sides may differ at most 200 times, got {width}x{height}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


class QwenVLProcessor(ImageProcessor):
    def __init__(self, cfg: dict, tok=None):
        super().__init__(cfg, tok)
        v, p = self.mm["vision_config"], self.pre
        self.patch = p.get("patch_size") or v.get("patch_size", 16)
        self.merge = p.get("merge_size") or v.get("spatial_merge_size", 2)
        self.temporal = p.get("temporal_patch_size") or v.get("temporal_patch_size", 2)
        size = p.get("size") or {}
        # transformers' Qwen2-VL processor defaults, for a folder without preprocessor_config.json
        self.min_pixels = p.get("min_pixels") or size.get("shortest_edge") or 56 * 56
        self.max_pixels = p.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280
        self.mean = p.get("image_mean") or MEAN_CLIP
        self.std = p.get("image_std") or STD_CLIP
        self.scale = p.get("rescale_factor") or 1 / 255
        self.placeholder_id = self.mm["image_token_id"]

    def prepare(self, img) -> ImageData:
        rgb = to_rgb(img)
        w, h = rgb.size
        rh, rw = smart_resize(h, w, self.patch * self.merge, self.min_pixels, self.max_pixels)
        pixels = np.asarray(rgb.resize((rw, rh), resample=Image.Resampling.BICUBIC), dtype=np.uint8).tobytes()
        gh, gw = rh // self.patch, rw // self.patch
        return ImageData(content_hash(pixels, rh, rw), 0, gh * gw // self.merge ** 2, rh, rw, pixels, (1, gh, gw))

    def replacement(self, im: ImageData) -> tuple[list[int], int]:
        return [self.placeholder_id] * im.length, 0

    def pixel_values(self, im: ImageData) -> np.ndarray:
        """[patches, 3 * temporal * patch * patch] float32, patches in merge-block order (as
        transformers' pixel_values)."""
        x = normalised(im, self.mean, self.std, self.scale)
        p, m, t = self.patch, self.merge, self.temporal
        _, gh, gw = im.grid
        x = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
        return np.ascontiguousarray(x).reshape(gh * gw, 3 * t * p * p)


def mrope_positions(num_tokens: int, images: list[ImageData], merge: int) -> tuple[np.ndarray, int]:
    """([3, num_tokens] int64 positions of a prompt, the shift of every position after it): text
    counts on from where the last image's grid ends, its three rows equal."""
    pos = np.empty((3, num_tokens), dtype=np.int64)
    at, nxt = 0, 0  # prompt index, next position
    for im in sorted(images, key=lambda i: i.offset):
        n = im.offset - at
        pos[:, at:im.offset] = np.arange(nxt, nxt + n)
        nxt += n
        _, gh, gw = im.grid
        h, w = gh // merge, gw // merge
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        end = im.offset + im.length
        pos[0, im.offset:end] = nxt
        pos[1, im.offset:end] = nxt + rows.ravel()
        pos[2, im.offset:end] = nxt + cols.ravel()
        nxt += max(h, w)
        at = end
    pos[:, at:] = np.arange(nxt, nxt + num_tokens - at)
    return pos, (int(pos.max()) if num_tokens else -1) + 1 - num_tokens

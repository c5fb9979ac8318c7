"""Gemma 3: every image is squashed to the encoder's square (896x896, pan-and-scan off), and the
chat template's <start_of_image> becomes "\\n\\n<start_of_image>", 256 soft tokens, "<end_of_image>\\n\\n"
(transformers' Gemma3Processor). The soft tokens of one image attend to each other both ways."""
from __future__ import annotations

from bisect import bisect_left

import numpy as np
from PIL import Image

from xinfer.ipc.media import ImageData
from xinfer.mm.base import (
    ImageProcessor,
    PromptImageError,
    content_hash,
    normalised,
    to_rgb,
)


def _mm_id(mm: dict, name: str, default: int) -> int:
    """A token id under either config spelling (`image_token_index` or `image_token_id`)."""
    return mm.get(f"{name}_index", mm.get(f"{name}_id", default))


class Gemma3Processor(ImageProcessor):
    def __init__(self, cfg: dict, tok=None):
        super().__init__(cfg, tok)
        v, p = self.mm["vision_config"], self.pre
        size = p.get("size") or {}
        side = v.get("image_size", 896)
        self.height, self.width = size.get("height", side), size.get("width", side)
        self.patch = v.get("patch_size", 14)
        self.resample = Image.Resampling(p.get("resample", Image.Resampling.BILINEAR))
        self.mean = p.get("image_mean") or (0.5, 0.5, 0.5)
        self.std = p.get("image_std") or (0.5, 0.5, 0.5)
        self.scale = p.get("rescale_factor") or 1 / 255
        self.tokens = self.mm.get("mm_tokens_per_image", 256)
        self.placeholder_id = _mm_id(self.mm, "boi_token", 255_999)
        self.image_id = _mm_id(self.mm, "image_token", 262_144)
        self.eoi_id = _mm_id(self.mm, "eoi_token", 256_000)
        self.runs: dict[int, int] = {}  # newline-run length -> its token
        if tok is not None:
            vocab = tok.tok.get_vocab(with_added_tokens=True)
            self.runs = {k: vocab["\n" * k] for k in range(1, 64) if "\n" * k in vocab}
        self.newlines = {t: k for k, t in self.runs.items()}

    def prepare(self, img) -> ImageData:
        rgb = to_rgb(img).resize((self.width, self.height), resample=self.resample)
        pixels = np.asarray(rgb, dtype=np.uint8).tobytes()
        h, w = self.height, self.width
        return ImageData(content_hash(pixels, h, w), 0, self.tokens, h, w, pixels,
                         (1, h // self.patch, w // self.patch), whole=True)

    def replacement(self, im: ImageData) -> tuple[list[int], int]:
        if 2 not in self.runs:
            raise PromptImageError("this Gemma 3 tokenizer has no \"\\n\\n\" token to frame an image with")
        nn = self.runs[2]
        return [nn, self.placeholder_id] + [self.image_id] * im.length + [self.eoi_id, nn], 2

    def expand(self, ids: list[int], images: list[ImageData]) -> list[int]:
        """transformers replaces the placeholder in the text, so a "\\n\\n" it adds merges with a newline
        run beside it into one token ("\\n" + "\\n\\n" is "\\n\\n\\n"): the same here."""
        out = super().expand(ids, images)
        added = {i for im in images for i in (im.offset - 2, im.offset + im.length + 1)}
        res, dropped, last_added = [], [], False
        for i, t in enumerate(out):
            k = self.newlines.get(t)
            prev = self.newlines.get(res[-1]) if res else None
            if k and prev and (i in added or last_added) and k + prev in self.runs:
                res[-1] = self.runs[k + prev]
                dropped.append(i)
                last_added = True
                continue
            res.append(t)
            last_added = i in added
        for im in images:
            im.offset -= bisect_left(dropped, im.offset)
        return res

    def pixel_values(self, im: ImageData) -> np.ndarray:
        """float32 [3, height, width], as transformers' pixel_values of one image."""
        return normalised(im, self.mean, self.std, self.scale)

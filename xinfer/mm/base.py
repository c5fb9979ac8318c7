"""What every family's image processor does the same way: RGB conversion, the content hash, and
the placeholder expansion of a rendered prompt."""
from __future__ import annotations

import abc
import hashlib
import io

import numpy as np
from PIL import Image, UnidentifiedImageError

from xinfer.ipc.media import ImageData

MEAN_CLIP = (0.48145466, 0.4578275, 0.40821073)
STD_CLIP = (0.26862954, 0.26130258, 0.27577711)


FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # a GIF is read as its first frame
# A decoded image is width x height x 3 bytes before the processor shrinks it: a few KB of PNG can
# claim gigapixels (a decompression bomb), so the size in the header is checked before decoding.
MAX_DECODED_PIXELS = 1 << 25


class PromptImageError(ValueError):
    """An image that can't be read, or a rendered prompt that disagrees with the images (a 400)."""


class Prompt(list):
    """Prompt token ids that carry their images (ImageData) along to the engine."""

    images: tuple | list = ()


def decode(data: bytes, i: int = 0):
    """A PIL image, fully decoded (PNG, JPEG, WebP, GIF); PromptImageError for a corrupt file or a bomb."""
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)
        w, h = img.size
        if w * h > MAX_DECODED_PIXELS or w < 1 or h < 1:
            raise PromptImageError(f"image {i}: {w}x{h} pixels is more than this server decodes "
                                   f"({MAX_DECODED_PIXELS})")
        img.load()  # the first frame only
        return img
    except (UnidentifiedImageError, Image.DecompressionBombError):
        raise PromptImageError(f"image {i}: not a PNG, JPEG, WebP or GIF image this server can read") from None
    except (OSError, ValueError, SyntaxError) as e:  # truncated or corrupt data
        if isinstance(e, PromptImageError):
            raise
        raise PromptImageError(f"image {i}: the image data is corrupt ({e})") from None


def to_rgb(img):
    """RGB, transparency composited onto white (as transformers' convert_to_rgb): a transparent
    PNG reads as the page it was drawn for, not as black."""
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return img.convert("RGB")


def content_hash(pixels: bytes, *shape: int) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray(shape, dtype=np.int64).tobytes())
    h.update(pixels)
    return h.digest()


def normalised(im: ImageData, mean, std, scale: float = 1 / 255) -> np.ndarray:
    """float32 (3, H, W): rescaled and normalised."""
    x = np.frombuffer(im.pixels, dtype=np.uint8).reshape(im.height, im.width, 3).transpose(2, 0, 1)
    x = x.astype(np.float32) * np.float32(scale)
    return (x - np.asarray(mean, np.float32)[:, None, None]) / np.asarray(std, np.float32)[:, None, None]


class ImageProcessor(abc.ABC):
    """One per served model. `placeholder_id`: the token the chat template writes once per image."""

    placeholder_id: int

    def __init__(self, cfg: dict, tok=None):
        """`tok`: the model's Tokenizer, for a family whose image tokens include text (None: pixels only)."""
        self.mm = cfg["_mm"]
        self.pre = self.mm.get("preprocessor") or {}
        self.tok = tok

    @abc.abstractmethod
    def prepare(self, img) -> ImageData:
        """A decoded PIL image as the encoder's input (offset not yet known)."""

    @abc.abstractmethod
    def replacement(self, im: ImageData) -> tuple[list[int], int]:
        """The tokens that stand for `im` in the prompt, and where its embeddings start among them."""

    def with_images(self, ids: list[int], images: list) -> Prompt:
        """`ids` expanded for the decoded (PIL) `images`, which it carries."""
        prepared = []
        for i, img in enumerate(images):
            try:
                prepared.append(self.prepare(img))
            except (ValueError, OSError) as e:  # an aspect ratio the processor refuses, a truncated file
                raise PromptImageError(f"image {i}: {e}") from None
        out = Prompt(self.expand(ids, prepared))
        out.images = prepared
        return out

    def expand(self, ids: list[int], images: list[ImageData]) -> list[int]:
        """`ids` with each image's placeholder replaced by its tokens; sets each image's offset. A
        placeholder without an image (typed by a client) or an image the template dropped is refused."""
        at = [i for i, t in enumerate(ids) if t == self.placeholder_id]
        if len(at) != len(images):
            raise PromptImageError(f"the prompt holds {len(at)} image placeholders for {len(images)} images "
                                   "(the chat template places one per image part; text may not contain them)")
        out, prev = [], 0
        for pos, im in zip(at, images):
            out.extend(ids[prev:pos])
            toks, first = self.replacement(im)
            im.offset = len(out) + first
            out.extend(toks)
            prev = pos + 1
        out.extend(ids[prev:])
        return out

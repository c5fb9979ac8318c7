"""Images on their way from the API process to the worker: decoded and resized there (the
family's processor, xinfer/mm/), sent as raw uint8 pixels, normalised and encoded in the worker."""
from __future__ import annotations

import msgspec


class ImageData(msgspec.Struct, array_like=True):
    hash: bytes  # of the resized pixels and their shape: the worker's embedding cache and the prefix cache key
    offset: int  # the prompt position of its first placeholder token
    length: int  # its placeholder tokens (the encoder's output rows)
    height: int  # pixels after the processor's resize
    width: int
    pixels: bytes  # uint8 RGB, height x width x 3, row-major
    grid: tuple[int, int, int] = (1, 0, 0)  # the encoder's patch grid (t, h, w), where the family has one
    # its tokens attend to each other both ways (Gemma 3): a prefill chunk never ends inside it, so
    # the step that computes its first token also holds its last (xinfer/ipc/media.py whole_images)
    whole: bool = False


def whole_images(images, start: int, n: int) -> int:
    """How many of `n` prompt tokens from `start` a prefill chunk takes so that it never ends inside
    a `whole` image: cut back to the image's first token, or, for a chunk that starts at or inside
    one, on to its last, past the chunk size and the step's token budget (the scheduler stops adding
    sequences once the budget is spent, so a step overruns it by one image at most)."""
    end = start + n
    for im in images:
        if im.whole and im.offset < end < im.offset + im.length:
            end = im.offset if im.offset > start else im.offset + im.length
    return end - start

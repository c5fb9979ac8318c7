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

"""A checkpoint tensor not read yet. A tensor-parallel rank keeps only its rows or columns of most
weights: the Linear loaders narrow a Lazy to their part, and only that part is read (a safetensors
slice) or dequantized (a GGUF tensor's block rows, or whole blocks of its columns), so a rank never
builds the whole tensor first. Every other loader gets a plain tensor (`materialize`)."""
from __future__ import annotations


class Lazy:
    def __init__(self, shape: tuple[int, ...], read, window: tuple[slice, ...] | None = None):
        """`read(window)`: the tensor under `window`, one slice a dimension."""
        self.shape = tuple(shape)
        self._read = read
        self._window = window or tuple(slice(0, n) for n in shape)

    def narrow(self, dim: int, start: int, count: int) -> "Lazy":
        if start < 0 or start + count > self.shape[dim]:
            raise ValueError(f"{start}:{start + count} is outside dimension {dim} of {self.shape}")
        base = self._window[dim].start
        window = self._window[:dim] + (slice(base + start, base + start + count),) + self._window[dim + 1:]
        return Lazy(self.shape[:dim] + (count,) + self.shape[dim + 1:], self._read, window)

    def tensor(self):
        t = self._read(self._window)
        if tuple(t.shape) != self.shape:
            raise ValueError(f"read {tuple(t.shape)} for a part of shape {self.shape}")
        return t


def materialize(t):
    return t.tensor() if isinstance(t, Lazy) else t


def reads_parts(loader):
    """Mark a weight_loader that takes a Lazy and reads only the part it keeps."""
    loader.reads_parts = True
    return loader

"""A lean reader of the GGUF container: metadata as plain Python values and memory-mapped tensor views.

gguf.GGUFReader builds numpy views for every element of every metadata array (a 49k-token
vocabulary is ~250k small objects): about 0.7 s for the bundled model, paid by every process that
opens it and again at each worker restart. This reader walks the same bytes with struct, builds
only the values, and lays tensors out exactly as GGUFReader does (what gguf.quants.dequantize expects).
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape


# GGUF metadata value types -> struct format (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_PLAIN = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # GGUF order: innermost dimension first
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray  # a view of the file's memory map


class GGUFFile:
    def __init__(self, path: str):
        self.path = path
        self.mm = np.memmap(path, mode="r")
        self.buf = self.mm.view(np.ndarray).data
        self.pos = 0
        magic, version = self._unpack("<4sI")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"not a GGUF v2/v3 file (magic {magic!r}, version {version})")
        n_tensors, n_kv = self._unpack("<QQ")
        self.fields: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.fields[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            ttype, offset = self._unpack("<IQ")
            infos.append((name, dims, GGMLQuantizationType(ttype), offset))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self.pos // align) * align
        self.tensors = [self._tensor(start, *info) for info in infos]

    def drop(self, t: GGUFTensor | None = None) -> None:
        """Give back the pages of tensor `t` (None: the whole file) that this process's mapping holds: a
        weight repacked from them (ops/qgemm.py) no longer needs them, and they would count in its
        resident memory. The page cache keeps them for whoever maps the file next."""
        mm = getattr(self.mm, "_mmap", None)
        if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start, end = (0, len(self.mm)) if t is None else (t.data_offset, t.data_offset + t.n_bytes)
        start = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the range only
        end = end // mmap.PAGESIZE * mmap.PAGESIZE if t is not None else end
        if end > start:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def _unpack(self, fmt: str) -> tuple:
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + n
        if self.pos > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        return bytes(self.buf[start:self.pos]).decode("utf-8", errors="replace")

    def _value(self, vtype: int):
        if vtype == 8:
            return self._string()
        if vtype == 9:
            etype, count = self._unpack("<IQ")
            if etype == 8:
                return [self._string() for _ in range(count)]
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype]).newbyteorder("<")
                end = self.pos + count * dt.itemsize
                if end > len(self.buf):
                    raise ValueError("an array runs past the end of the file")
                out = np.frombuffer(self.buf[self.pos:end], dtype=dt).tolist()
                self.pos = end
                return out
            return [self._value(etype) for _ in range(count)]  # arrays of arrays
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self._unpack("<" + _SCALARS[vtype])[0]

    def _tensor(self, start: int, name: str, dims: tuple, ttype: GGMLQuantizationType, offset: int) -> GGUFTensor:
        n_elems = int(np.prod(dims))
        block, type_size = GGML_QUANT_SIZES[ttype]
        n_bytes = n_elems * type_size // block
        np_dims = tuple(reversed(dims))
        data_offset = start + offset
        if data_offset + n_bytes > len(self.mm):
            raise EOFError(f"tensor {name} ends at byte {data_offset + n_bytes} but the file has {len(self.mm)}")
        if ttype in _PLAIN:
            data = self.mm[data_offset:data_offset + n_bytes].view(_PLAIN[ttype]).reshape(np_dims)
        else:
            data = self.mm[data_offset:data_offset + n_bytes].reshape(quant_shape_to_byte_shape(np_dims, ttype))
        return GGUFTensor(name, ttype, np.array(dims, dtype=np.uint64), n_elems, n_bytes, data_offset,
                          data.view(np.ndarray))

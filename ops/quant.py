"""GGUF block-quantized weights kept as they are on the CPU (ops/cpu_kernels.c).

A decode step at small batch reads every weight once and does little with it, so it is bound by
memory: Q4_1 is 6 bits a weight here (nibbles plus float32 d and m per 32) against float32's 32.
`QuantWeight` holds a linear's blocks next to its float32 weight; `linear()` sends batches of up to
its `max_rows` rows to the kernel and bigger ones to oneDNN's GEMM, which is faster once the
weights are reused across many rows. The kernel rebuilds each weight exactly as the GGUF reference
dequantizes it, so the two paths agree to float32 rounding.

Where the kernels cannot be built (`ops.cpu_kernels.available()` is False), the float32
path runs alone. XINFER_QUANT_MAX_ROWS moves the crossover (measured in bench/NOTES-cpu.md).
"""
from __future__ import annotations


import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from ops import cpu_isa
from ops.cpu_kernels import has_bf16, lib, simd_width
from ops.block_types import BLOCK_TYPES

MATMULS = ("float32", "bfloat16", "int16")  # --cpu-matmul's settings, in the kernels' PREC_* order
PREC = {m: i for i, m in enumerate(MATMULS)}


_ONE, _ZERO = np.array([1.0], np.float16).view(np.uint8), np.zeros(2, np.uint8)
# Types read as q8 blocks: (scales per 32 weights, the fields that make gguf's own dequantization
# return the plain integers q: {byte offset in a block: bytes}, and how to read d and m (None: no m)).
# The integers come from gguf.quants.dequantize itself on blocks whose scales are set to one and
# offsets to zero, so no bit layout is written twice.
_Q8_TYPES = {
    "Q8_0": (1, {0: _ONE}),
    "Q5_0": (1, {0: _ONE}),
    "Q5_1": (1, {0: _ONE, 2: _ZERO}),
    "Q5_K": (1, {0: _ONE, 2: _ZERO, 4: np.array([1] * 4 + [0] * 4 + [1] * 4, np.uint8)}),
    "Q6_K": (2, {192: np.ones(16, np.uint8), 208: _ONE}),
    "Q2_K": (2, {0: np.ones(16, np.uint8), 80: _ONE, 82: _ZERO}),
}


def _half(b: np.ndarray, at: int) -> np.ndarray:
    return b[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: twelve bytes -> eight 6-bit scales and eight 6-bit mins."""
    scales = np.concatenate([sc[..., 0:4] & 63, (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4)], -1)
    mins = np.concatenate([sc[..., 4:8] & 63, (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)], -1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _scales(type_name: str, b: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """d and m (or None) of each q8 scale group, [rows, blocks, groups], in float32 as the GGUF
    reference computes them (each product exact: 11-bit halves times 4- to 8-bit integers)."""
    if type_name in ("Q8_0", "Q5_0"):
        return _half(b, 0)[..., None], None
    if type_name == "Q5_1":
        return _half(b, 0)[..., None], _half(b, 2)[..., None]
    if type_name == "Q5_K":
        sc, mn = _k_scales(b[..., 4:16])
        return _half(b, 0)[..., None] * sc, -(_half(b, 2)[..., None] * mn)
    if type_name == "Q6_K":
        return _half(b, 208)[..., None] * b[..., 192:208].view(np.int8).astype(np.float32), None
    sc = b[..., 0:16]  # Q2_K: a scale in the low nibble, a min in the high one
    return _half(b, 80)[..., None] * (sc & 15).astype(np.float32), -(_half(b, 82)[..., None] * (sc >> 4).astype(np.float32))


class QuantWeight:
    """One linear's weight [N, K] as 32-weight blocks. q4: nibbles, d and m per block; q8: signed
    bytes, `gs` (1 or 2) scales d a block and optional offsets m (ops/cpu_kernels.c)."""

    DIRECT = {"Q4_0", "Q4_1", "Q4_K", "Q8_0"}  # decoded here, without gguf's dequantizer

    def __init__(self, kind: str, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, shape, gs: int = 1):
        self.kind, self.qs, self.d, self.m, self.shape, self.gs = kind, qs, d, m, tuple(shape), gs
        self.prec = 0  # the kernels' arithmetic: PREC's value for --cpu-matmul (ops/cpu_kernels.c)
        self.panels = None  # bfloat16: (bytes, d, m) in 16-column panels (ops/cpu_kernels.c panel_dot)
        self.wide = None  # int16 on AVX2: the integers widened to 16 bits in 8-column panels (mm_i16p), 2 B a weight
        self.max_rows = cpu_isa.block_rows()  # the largest batch linear() sends here (use() sets it)

    def use(self, matmul: str) -> None:
        """--cpu-matmul: float32 (exact weights, float32 sums), bfloat16 (rounded, where the CPU has
        the dot products; q4 weights in panels stay exact) or int16 (activations quantized per 32
        values to 16 bits). In bfloat16, q4 weights and q8 ones with one scale a block also get their
        panels, which every batch up to `max_rows` reads (one row too: one stream a thread, measured
        faster in bench/NOTES-cpu.md)."""
        self.prec = PREC[matmul]
        self.wide = None
        n, k = self.shape
        # bfloat16 panels of 16 columns where the CPU has its dot products; float32 ones of 8 in the
        # AVX2 build (the AVX-512 build keeps its row kernels there)
        width = 16 if matmul == "bfloat16" and has_bf16() else 8 if matmul != "bfloat16" and simd_width() == 256 else 0
        if not width or n % width or self.gs != 1:
            width = 0
        self.max_rows = cpu_isa.block_rows(bf16_panels=width == 16)
        if not width:
            self.panels = None
            return
        kind = 0 if self.kind == "q4" else 1
        # int16 in the AVX2 build: past INT16_ROWS (up to max_rows) the batches read the widened integers,
        # and the 8-column panels only lend their scales
        wide = matmul == "int16" and width == 8
        self.panels = (None if wide else torch.zeros(n * k // (2 - kind), dtype=torch.uint8),
                       torch.empty(n * k // 32), torch.empty(n * k // 32))
        build = lib().xinfer_panels if width == 16 else lib().xinfer_panels8
        build(self.qs.data_ptr(), self.d.data_ptr(), None if self.m is None else self.m.data_ptr(), kind, n, k,
              *(None if t is None else t.data_ptr() for t in self.panels))
        self.wide = torch.empty(n * k, dtype=torch.int16) if wide else None
        if wide:
            lib().xinfer_panels_i16(self.qs.data_ptr(), kind, n, k, self.wide.data_ptr())

    @classmethod
    def from_gguf(cls, type_name: str, blocks: np.ndarray, shape) -> "QuantWeight":
        """`blocks` [N, K / block weights * block bytes] uint8, GGUF's own bytes."""
        n, k = shape
        if type_name == "Q4_K":
            return cls._from_q4_k(blocks, shape)
        size, nbytes = BLOCK_TYPES[type_name]
        b = blocks.reshape(n, k // size, nbytes)
        if type_name in _Q8_TYPES:
            gs, unit = _Q8_TYPES[type_name]
            if type_name == "Q8_0":  # its integers are its bytes: no need to decode a copy (the head is big)
                q = b[..., 2:].copy().view(np.int8).reshape(n, k)
            else:
                plain = b.copy()
                for at, v in unit.items():
                    plain[..., at:at + len(v)] = v
                q = dequantize(plain.reshape(n, -1), GGMLQuantizationType[type_name]).reshape(n, k).astype(np.int8)
            d, m = _scales(type_name, b)
            t = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a).reshape(n, k // 32 * gs))  # noqa: E731
            return cls("q8", torch.from_numpy(q), t(d), t(m), shape, gs)
        d = _half(b, 0)
        if type_name == "Q4_1":
            m = _half(b, 2)
            qs = b[..., 4:]
        else:  # Q4_0: d * (q - 8) = d * q + (-8 d), exactly
            m = -8.0 * d
            qs = b[..., 2:]
        return cls("q4", torch.from_numpy(qs.reshape(n, k // 2).copy()), torch.from_numpy(d), torch.from_numpy(m),
                   shape)

    @classmethod
    def _from_q4_k(cls, blocks: np.ndarray, shape) -> "QuantWeight":
        """Q4_K: per 256 weights, float16 d and dmin, twelve bytes of 6-bit scales and mins for
        eight sub-blocks of 32, and 128 bytes of nibbles (each 32 bytes: sub-block 2i in the low
        nibbles, 2i + 1 in the high). Weight = d * sc * q - dmin * mn: a q4 block with d' = d * sc
        and m' = -(dmin * mn), computed in float32 as the GGUF reference does."""
        n, k = shape
        b = blocks.reshape(n, k // 256, 144)
        scales, mins = _k_scales(b[..., 4:16])
        q = b[..., 16:].reshape(n, k // 256, 4, 32)
        vals = np.stack([q & 15, q >> 4], axis=3).reshape(n, k // 32, 32)  # sub-blocks in order
        qs = vals[..., :16] | (vals[..., 16:] << 4)  # the q4 layout: weights 0-15 low, 16-31 high
        dd = (_half(b, 0)[..., None] * scales).reshape(n, k // 32)
        mm = -(_half(b, 2)[..., None] * mins).reshape(n, k // 32)
        return cls("q4", torch.from_numpy(qs.astype(np.uint8).reshape(n, k // 2)), torch.from_numpy(dd),
                   torch.from_numpy(mm), shape)

    def as_q8(self, gs: int, with_m: bool) -> "QuantWeight":
        """The same weights as q8 blocks with `gs` scales a block (and offsets): what lets parts in
        different types be fused into one weight."""
        n, k = self.shape
        if self.kind == "q4":
            q = self.qs.view(n, k // 32, 16)
            q = torch.cat([q & 0xF, q >> 4], dim=-1).to(torch.int8).view(n, k)
            w = QuantWeight("q8", q, self.d, self.m, self.shape)
        else:
            w = self
        d, m = w.d, w.m
        if gs > w.gs:
            d = d.repeat_interleave(gs // w.gs, dim=1)
            m = None if m is None else m.repeat_interleave(gs // w.gs, dim=1)
        if with_m and m is None:
            m = torch.zeros_like(d)
        return w._like(w.qs, d.contiguous(), m if m is None else m.contiguous(), self.shape, gs)

    @staticmethod
    def cat(parts: list["QuantWeight"]) -> "QuantWeight | None":
        """Fused weights (QKV, gate-up): the parts' rows one after the other; parts of different kinds
        (Q4_K_M's Q6_K value rows beside Q4_K ones) are all read as q8. None if their widths differ."""
        if len({p.shape[1] for p in parts}) != 1:
            return None
        if len({(p.kind, p.gs, p.m is None) for p in parts}) > 1:
            gs, with_m = max(p.gs for p in parts), any(p.m is not None for p in parts)
            parts = [p.as_q8(gs, with_m) for p in parts]
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])
        return QuantWeight(parts[0].kind, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m,
                           (sum(p.shape[0] for p in parts), parts[0].shape[1]), parts[0].gs)

    def narrow(self, dim: int, start: int, count: int) -> "QuantWeight":
        """Rows, or whole 32-weight blocks of columns (a tensor-parallel rank's part)."""
        n, k = self.shape
        if dim == 0:
            sl, shape = (slice(start, start + count), slice(None)), (count, k)
            part = lambda t: t[sl].contiguous()  # noqa: E731
            return self._like(part(self.qs), part(self.d), None if self.m is None else part(self.m), shape)
        if start % 32 or count % 32:
            raise ValueError(f"columns {start}:{start + count} cut a 32-weight block")
        per = self.qs.shape[1] // (k // 32)  # bytes of a block in qs
        b0, b1 = start // 32, (start + count) // 32
        g0, g1 = b0 * self.gs, b1 * self.gs
        m = None if self.m is None else self.m[:, g0:g1].contiguous()
        return self._like(self.qs[:, b0 * per:b1 * per].contiguous(), self.d[:, g0:g1].contiguous(), m, (n, count))

    def _like(self, qs, d, m, shape, gs: int | None = None) -> "QuantWeight":
        q = QuantWeight(self.kind, qs, d, m, shape, self.gs if gs is None else gs)
        q.use(MATMULS[self.prec])
        return q

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        if self.kind == "q8":
            g = k // 32 * self.gs
            w = self.qs.float().view(n, g, -1) * self.d[..., None]
            return (w if self.m is None else w + self.m[..., None]).view(n, k)
        q = self.qs.view(n, k // 32, 16)
        q = torch.cat([q & 0xF, q >> 4], dim=-1).float()
        return (q * self.d[..., None] + self.m[..., None]).view(n, k)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        rows, (n, k) = x.shape[0], self.shape
        y = torch.empty(rows, n, dtype=torch.float32)
        panels = [None if p is None else p.data_ptr() for p in (*(self.panels or (None,) * 3), self.wide)]
        if self.kind == "q4":
            lib().xinfer_q4_mm(self.qs.data_ptr(), self.d.data_ptr(), self.m.data_ptr(), x.data_ptr(), y.data_ptr(),
                               rows, n, k, self.prec, *panels)
        else:
            lib().xinfer_q8_mm(self.qs.data_ptr(), self.d.data_ptr(), None if self.m is None else self.m.data_ptr(),
                               self.gs, x.data_ptr(), y.data_ptr(), rows, n, k, self.prec, *panels)
        return y

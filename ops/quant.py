"""GGUF block-quantized weights kept as they are on the CPU (ops/cpu_kernels.c).

A decode step at small batch reads every weight once and does little with it, so it is bound by
memory: Q4_1 is 6 bits a weight here (nibbles plus float32 d and m per 32) against float32's 32.
`QuantWeight` holds a linear's blocks next to its float32 weight; `linear()` sends batches of up to
`MAX_ROWS` rows to the kernel and bigger ones to oneDNN's float32 GEMM, which is faster once the
weights are reused across many rows. The kernel rebuilds each weight exactly as the GGUF reference
dequantizes it, so the two paths agree to float32 rounding.

Where the kernels cannot be built (`ops.cpu_kernels.available()` is False), the float32
path runs alone. XINFER_QUANT_MAX_ROWS moves the crossover (measured in bench/NOTES-cpu.md).
"""
from __future__ import annotations


import numpy as np
import torch

from ops.cpu_kernels import lib
from xinfer.loader.gguf import BLOCK_TYPES
from xinfer import envs

def max_rows(bf16: bool) -> int:
    """Where the block kernels stop paying: float32 GEMMs catch up at ~16 rows, bfloat16 ones at ~8-16
    (2-core Zen 4, bench/NOTES-cpu.md)."""
    return envs.quant_max_rows() or (12 if bf16 else 16)


MAX_ROWS = max_rows(False)


class QuantWeight:
    """One linear's weight [N, K] as 32-weight blocks (q4: nibbles, d, m; q8: bytes, d)."""

    def __init__(self, kind: str, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, shape):
        self.kind, self.qs, self.d, self.m, self.shape = kind, qs, d, m, tuple(shape)
        self.bf16 = False  # --cpu-matmul bfloat16: the kernels' bfloat16 dot products, where the CPU has them

    @classmethod
    def from_gguf(cls, type_name: str, blocks: np.ndarray, shape) -> "QuantWeight":
        """`blocks` [N, K / 32 * bytes per block] uint8, GGUF's own bytes."""
        n, k = shape
        if type_name == "Q4_K":
            return cls._from_q4_k(blocks, shape)
        b = blocks.reshape(n, k // 32, BLOCK_TYPES[type_name][1])
        d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if type_name == "Q8_0":
            return cls("q8", torch.from_numpy(b[..., 2:].copy().view(np.int8).reshape(n, k)), torch.from_numpy(d),
                       None, shape)
        if type_name == "Q4_1":
            m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
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
        d = b[..., 0:2].copy().view(np.float16).astype(np.float32)  # [n, S, 1]
        dmin = b[..., 2:4].copy().view(np.float16).astype(np.float32)
        sc = b[..., 4:16].astype(np.uint8)
        scales = np.concatenate([sc[..., 0:4] & 63, (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4)], -1)
        mins = np.concatenate([sc[..., 4:8] & 63, (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)], -1)
        q = b[..., 16:].reshape(n, k // 256, 4, 32)
        vals = np.stack([q & 15, q >> 4], axis=3).reshape(n, k // 32, 32)  # sub-blocks in order
        qs = vals[..., :16] | (vals[..., 16:] << 4)  # the q4 layout: weights 0-15 low, 16-31 high
        dd = (d * scales.astype(np.float32)).reshape(n, k // 32)
        mm = -(dmin * mins.astype(np.float32)).reshape(n, k // 32)
        return cls("q4", torch.from_numpy(qs.astype(np.uint8).reshape(n, k // 2)), torch.from_numpy(dd),
                   torch.from_numpy(mm), shape)

    @staticmethod
    def cat(parts: list["QuantWeight"]) -> "QuantWeight | None":
        """Fused weights (QKV, gate-up): the parts' rows one after the other; None if kinds differ."""
        if len({p.kind for p in parts}) != 1 or len({p.shape[1] for p in parts}) != 1:
            return None
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])
        return QuantWeight(parts[0].kind, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m,
                           (sum(p.shape[0] for p in parts), parts[0].shape[1]))

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
        m = None if self.m is None else self.m[:, b0:b1].contiguous()
        return self._like(self.qs[:, b0 * per:b1 * per].contiguous(), self.d[:, b0:b1].contiguous(), m, (n, count))

    def _like(self, qs, d, m, shape) -> "QuantWeight":
        q = QuantWeight(self.kind, qs, d, m, shape)
        q.bf16 = self.bf16
        return q

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        if self.kind == "q8":
            return (self.qs.float().view(n, k // 32, 32) * self.d[..., None]).view(n, k)
        q = self.qs.view(n, k // 32, 16)
        q = torch.cat([q & 0xF, q >> 4], dim=-1).float()
        return (q * self.d[..., None] + self.m[..., None]).view(n, k)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        rows, (n, k) = x.shape[0], self.shape
        y = torch.empty(rows, n, dtype=torch.float32)
        if self.kind == "q4":
            lib().xinfer_q4_mm(self.qs.data_ptr(), self.d.data_ptr(), self.m.data_ptr(), x.data_ptr(), y.data_ptr(),
                               rows, n, k, self.bf16)
        else:
            lib().xinfer_q8_mm(self.qs.data_ptr(), self.d.data_ptr(), x.data_ptr(), y.data_ptr(), rows, n, k, self.bf16)
        return y

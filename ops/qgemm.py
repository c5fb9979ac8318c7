"""GGUF Q4_K, Q6_K and Q8_0 weights held once, in their own bits, for batches of every size
(ops/cpu_qgemm.c): the activations quantized to 8 bits a value with a scale per 32 (as llama.cpp
does for Q8_0 weights; finer than its Q8_K for the K-quants), the dot products on the VNNI units. No float or bfloat16 copy of such a weight exists, so a model takes about
its file's size in memory, and prefill runs on the blocks at the integer units' rate.

A `PackedWeight` is one linear's weight [N, K]; a fused one (QKV, gate-up) is several parts, each
in its own type, writing its own columns of the output. Taken where the CPU has AVX512-VNNI
(`available()`) and the shapes fit (16-row panels, whole super-blocks); other weights keep the
block kernels of ops/quant.py. XINFER_QGEMM=0 turns it off.

A `Bf16Weight` is the same idea for float weights on the bfloat16 path: one bfloat16 copy in
16-column panels that every batch and the one-call decode step read.
"""
from __future__ import annotations

import numpy as np
import torch

from ops import cpu_isa, cpu_kernels, envs
from ops.cpu_kernels import lib

KINDS = {"Q4_K": 0, "Q6_K": 1, "Q8_0": 2}
_BLOCK = {0: 256, 1: 256, 2: 32}  # inputs a super-block


def available() -> bool:
    """The kernels are built with AVX512-VNNI, and the CPU level (XINFER_CPU_ISA) has it."""
    so = lib()
    return (envs.qgemm() and so is not None and bool(so.xinfer_qg_available())
            and cpu_isa.LEVELS.index(cpu_isa.level()) >= cpu_isa.LEVELS.index("avx512_vnni"))


def fits(type_name: str, shape) -> bool:
    n, k = shape
    return type_name in KINDS and n % 16 == 0 and k % _BLOCK[KINDS[type_name]] == 0


class PackedWeight:
    """Parts [(kind, rows, packed bytes)] one after another along N; all share K."""

    max_rows = 1 << 30  # linear() sends it every batch

    def __init__(self, parts: list[tuple[int, int, torch.Tensor]], k: int):
        self.parts = parts
        self.shape = (sum(n for _, n, _ in parts), k)

    @classmethod
    def from_gguf(cls, type_name: str, blocks: np.ndarray, shape) -> "PackedWeight":
        """`blocks` [N, K / block weights * block bytes] uint8, GGUF's own bytes (a view of the file)."""
        n, k = shape
        kind = KINDS[type_name]
        out = torch.empty(lib().xinfer_qg_bytes(kind, n, k), dtype=torch.uint8)
        src = np.ascontiguousarray(blocks)
        lib().xinfer_qg_pack(kind, src.ctypes.data, n, k, out.data_ptr())
        return cls([(kind, n, out)], k)

    @staticmethod
    def cat(parts: list["PackedWeight"]) -> "PackedWeight | None":
        if len({p.shape[1] for p in parts}) != 1:
            return None
        return PackedWeight([q for p in parts for q in p.parts], parts[0].shape[1])

    def narrow(self, dim: int, start: int, count: int):
        raise ValueError("packed weights are not split")  # tensor parallel keeps ops/quant.py's blocks

    def use(self, matmul: str) -> None:
        """--cpu-matmul does not apply: the arithmetic is the integer units'."""

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight in float32, as GGUF dequantizes them (an embedding lookup)."""
        (kind, _, w), = self.parts
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), self.shape[1])
        lib().xinfer_qg_rows(kind, w.data_ptr(), self.shape[1], flat.data_ptr(), flat.numel(), out.data_ptr())
        return out.view(*ids.shape, self.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().contiguous()
        m, k = x.shape
        y = torch.empty(m, self.shape[0], dtype=torch.float32)
        so = lib()
        # the activations once for every part: int8 q (rows padded, cpu_qgemm.c QLD), d per 32, int16 sums
        # per 16 and 32, d * sum per 32
        acts = (torch.empty(m, k + 64, dtype=torch.int8), torch.empty(m, k // 32), torch.empty(m, k // 16, dtype=torch.int16),
                torch.empty(m, k // 32, dtype=torch.int16), torch.empty(m, k // 32))
        so.xinfer_qg_quant(x.data_ptr(), m, k, *(t.data_ptr() for t in acts))
        col = 0
        for kind, n, w in self.parts:
            so.xinfer_qg_mm(kind, w.data_ptr(), n, k, *(t.data_ptr() for t in acts), m, y[:, col:].data_ptr(), self.shape[0])
            col += n
        return y


class Bf16Weight:
    """A bfloat16 weight [N, K] held once, in 16-column panels (ops/cpu_kernels.c xinfer_bf16_pack), for
    every batch: the inputs rounded to bfloat16 and float32 sums, as oneDNN's bfloat16 GEMM does, in
    one layout that the one-call decode step reads too (oneDNN's packed copy is opaque to it). Taken
    with --cpu-matmul bfloat16 where the kernels have AVX512_BF16 (`available`, `usable` for a shape)."""

    # linear() sends it every batch (its float weight is gone); the one-call decode step takes batches
    # up to this many rows: past them a step is GEMM-bound, and the C step's barriers (~300 a step) cost
    # more than the Python they save once the API process shares the cores (Qwen3-0.6B shape, served,
    # 64 clients: 78.7 tok/s through the C step, 83.6 op by op)
    max_rows = 16

    def __init__(self, panels: torch.Tensor, n: int, k: int):
        self.panels = panels  # [N / 16, K / 2, 32] bfloat16
        self.shape = (n, k)

    @staticmethod
    def available() -> bool:
        """The kernels are built with AVX512_BF16 dot products (and XINFER_QGEMM is not 0)."""
        return envs.qgemm() and cpu_kernels.has_bf16()

    @staticmethod
    def usable(shape) -> bool:
        n, k = shape
        return Bf16Weight.available() and n % 16 == 0 and k % 32 == 0

    @classmethod
    def of(cls, w: torch.Tensor) -> "Bf16Weight":
        n, k = w.shape
        w = w.detach().to(torch.bfloat16).contiguous()
        out = torch.empty(n // 16, k // 2, 32, dtype=torch.bfloat16)
        lib().xinfer_bf16_pack(w.data_ptr(), n, k, out.data_ptr())
        return cls(out, n, k)

    @staticmethod
    def cat(parts: list["Bf16Weight"]) -> "Bf16Weight | None":
        if len({p.shape[1] for p in parts}) != 1:
            return None
        return Bf16Weight(torch.cat([p.panels for p in parts]), sum(p.shape[0] for p in parts), parts[0].shape[1])

    def narrow(self, dim: int, start: int, count: int):
        raise ValueError("packed weights are not split")

    def use(self, matmul: str) -> None:
        """Always bfloat16."""

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` in float32 (an embedding lookup): column c of panel g, its pairs at lanes 2c, 2c + 1."""
        flat = ids.reshape(-1).to(torch.int64)
        p = self.panels.view(self.shape[0] // 16, self.shape[1] // 2, 16, 2)
        return p[flat // 16, :, flat % 16].reshape(*ids.shape, self.shape[1]).float()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x = x.float().contiguous()
        y = torch.empty(x.shape[0], self.shape[0], dtype=torch.float32)
        lib().xinfer_bf16_mm(self.panels.data_ptr(), None if bias is None else bias.data_ptr(), x.data_ptr(),
                             y.data_ptr(), x.shape[0], *self.shape)
        return y

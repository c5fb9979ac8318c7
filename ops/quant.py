"""GGUF block-quantized weights kept as they are on the CPU (ops/cpu_kernels.c).

A decode step at small batch reads every weight once and does little with it, so it is bound by
memory: Q4_1 is 6 bits a weight here (nibbles plus float32 d and m per 32) against float32's 32.
`QuantWeight` holds a linear's blocks next to its float32 weight; `linear()` sends batches of up to
`MAX_ROWS` rows to the kernel and bigger ones to oneDNN's float32 GEMM, which is faster once the
weights are reused across many rows. The kernel rebuilds each weight exactly as the GGUF reference
dequantizes it, so the two paths agree to float32 rounding.

The kernel is compiled on first use with the system C compiler (-march=native, OpenMP linked to
torch's own runtime) into a cache folder keyed by the source, the compiler and the CPU; where that
fails (no compiler, no AVX-512), `available()` is False and the float32 path runs alone.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("xinfer.ops")

SRC = Path(__file__).with_name("cpu_kernels.c")
MAX_ROWS = int(os.environ.get("XINFER_QUANT_MAX_ROWS", "8"))
# GGUF type name -> (bytes per 32-weight block, layout)
BLOCK_TYPES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def _cache_dir() -> Path:
    base = os.environ.get("XINFER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "xinfer")
    return Path(base) / "kernels"


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
        model = next((ln for ln in info.splitlines() if ln.startswith("model name")), "")
        return model + flags
    except OSError:
        return platform.processor()


@functools.cache
def _lib():
    """The compiled kernels, or None (logged once) where they cannot be built here."""
    if platform.machine() not in ("x86_64", "AMD64") or os.environ.get("XINFER_QUANT_KERNELS") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler: GGUF quantized kernels off, float32 weights only")
        return None
    torch_lib = Path(torch.__file__).parent / "lib"
    key = hashlib.sha256(SRC.read_bytes() + cc.encode() + _cpu_id().encode() + str(torch_lib).encode()).hexdigest()[:16]
    out = _cache_dir() / f"cpu_kernels-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        # Linking the libgomp.so.1 that torch ships makes both use one OpenMP thread pool.
        gomp = ["-L", str(torch_lib), f"-Wl,-rpath,{torch_lib}"] if (torch_lib / "libgomp.so.1").exists() else []
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_out = Path(tmp) / out.name
            cmd = [cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(SRC), "-o", str(tmp_out)] + gomp
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                log.info("GGUF quantized kernels could not be built here (%s): float32 weights only",
                         (r.stderr.strip().splitlines() or ["?"])[-1][:200])
                return None
            os.replace(tmp_out, out)  # atomic: concurrent workers never load a half-written file
    lib = ctypes.CDLL(str(out))
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.xinfer_q4_mm.argtypes = [p, p, p, p, p, i, i, i]
    lib.xinfer_q8_mm.argtypes = [p, p, p, p, i, i, i]
    return lib


def available() -> bool:
    return _lib() is not None


class QuantWeight:
    """One linear's weight [N, K] as 32-weight blocks (q4: nibbles, d, m; q8: bytes, d)."""

    def __init__(self, kind: str, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, shape):
        self.kind, self.qs, self.d, self.m, self.shape = kind, qs, d, m, tuple(shape)

    @classmethod
    def from_gguf(cls, type_name: str, blocks: np.ndarray, shape) -> "QuantWeight":
        """`blocks` [N, K / 32 * bytes per block] uint8, GGUF's own bytes."""
        n, k = shape
        b = blocks.reshape(n, k // 32, BLOCK_TYPES[type_name])
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

    @staticmethod
    def cat(parts: list["QuantWeight"]) -> "QuantWeight | None":
        """Fused weights (QKV, gate-up): the parts' rows one after the other; None if kinds differ."""
        if len({p.kind for p in parts}) != 1 or len({p.shape[1] for p in parts}) != 1:
            return None
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])
        return QuantWeight(parts[0].kind, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m,
                           (sum(p.shape[0] for p in parts), parts[0].shape[1]))

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
        lib = _lib()
        if self.kind == "q4":
            lib.xinfer_q4_mm(self.qs.data_ptr(), self.d.data_ptr(), self.m.data_ptr(), x.data_ptr(), y.data_ptr(),
                             rows, n, k)
        else:
            lib.xinfer_q8_mm(self.qs.data_ptr(), self.d.data_ptr(), x.data_ptr(), y.data_ptr(), rows, n, k)
        return y

"""Every environment variable the kernel layer reads (ops/ imports nothing from xinfer/), read when
asked so tests can set them; the engine's are in xinfer/envs.py."""
from __future__ import annotations

import os


def flag(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if v is None or not v.strip():
        return default
    return v.strip().lower() not in ("0", "false", "no", "off")


def quant_max_rows() -> int | None:
    """XINFER_QUANT_MAX_ROWS: the largest batch that reads GGUF blocks (more rows use the GEMMs);
    default: where the GEMMs were measured to catch up (ops/quant.py MAX_ROWS)."""
    v = os.environ.get("XINFER_QUANT_MAX_ROWS")
    return int(v) if v else None


def cpu_decode() -> bool:
    """XINFER_CPU_DECODE=0: the op-by-op decode step instead of the one-call C step."""
    return os.environ.get("XINFER_CPU_DECODE", "1") != "0"


def qgemm() -> bool:
    """XINFER_QGEMM=0: GGUF Q4_K / Q6_K / Q8_0 weights take ops/quant.py's blocks and a float copy, as
    before ops/qgemm.py (for comparisons)."""
    return os.environ.get("XINFER_QGEMM") != "0"


def cpu_kernels() -> bool:
    """XINFER_CPU_KERNELS=0: do not build or use ops/cpu_kernels.c."""
    return os.environ.get("XINFER_CPU_KERNELS") != "0"


def cpu_march() -> str | None:
    """XINFER_CPU_MARCH: -march for the CPU kernels (default: native, or the level XINFER_CPU_ISA forces)."""
    return os.environ.get("XINFER_CPU_MARCH") or None


def cpu_isa() -> str | None:
    """XINFER_CPU_ISA: a lower vector-unit level to run at (ops/cpu_isa.py), to test its paths."""
    return os.environ.get("XINFER_CPU_ISA") or None


def cache_dir() -> str:
    """XINFER_CACHE_DIR: where built kernels are kept (default ~/.cache/xinfer)."""
    return os.environ.get("XINFER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "xinfer")


def onednn() -> bool:
    """XINFER_ONEDNN=0: float32 matmuls through MKL instead of oneDNN."""
    return os.environ.get("XINFER_ONEDNN", "1") != "0"


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def c_compiler() -> str | None:
    """CC: the compiler for the CPU kernels (else cc or gcc on PATH)."""
    return os.environ.get("CC") or None


def triton_ops() -> bool:
    """XINFER_TRITON_OPS=1: the fused Triton norm, activation and rotary kernels (ops/triton_fused.py)
    on the CPU too, through the interpreter (tests); on CUDA they run whenever Triton is installed."""
    return flag("XINFER_TRITON_OPS", False)

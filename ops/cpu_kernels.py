"""Builds and loads ops/cpu_kernels.c, the C kernels of the CPU path (GGUF block matmuls, paged
decode attention, fused residual-add + RMSNorm, rotary in place, and a whole decode step).

Compiled on first use with the system C compiler (-O3 -march=native -fopenmp, OpenMP linked to the
libgomp that torch ships so both share one thread pool) into a cache folder keyed by the source,
the compiler, the CPU and the target; a build is written under a temporary name and renamed, so
concurrent processes never load half a file. The matmuls come in AVX-512 and AVX2 + FMA versions.
Where the build fails (no compiler, neither of those, not x86), `available()` is False and every
caller keeps its torch path. XINFER_CPU_KERNELS=0 turns them off; XINFER_CPU_MARCH sets -march
(e.g. `haswell` builds the AVX2 version on an AVX-512 machine, as the tests do).
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

import torch
from ops import cpu_isa
from ops import envs

log = logging.getLogger("xinfer.ops")

SRC = Path(__file__).with_name("cpu_kernels.c")
QGEMM = Path(__file__).with_name("cpu_qgemm.c")  # compiled into the same library (ops/qgemm.py)


def _cache_dir() -> Path:
    return Path(envs.cache_dir()) / "kernels"


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
        model = next((ln for ln in info.splitlines() if ln.startswith("model name")), "")
        return model + flags
    except OSError:
        return platform.processor()


_swapped = None  # another build in place of these (swap: `xinfer-bench offline --baseline-kernels`)


def lib():
    """The compiled kernels, or None (logged once) where they cannot be built here."""
    return _swapped if _swapped is not None else _shipped()


@functools.cache
def _shipped():
    if platform.machine() not in ("x86_64", "AMD64") or not envs.cpu_kernels():
        return None
    return load(SRC)


def swap(so) -> None:
    """Every later lib() call gets `so` (a load() of another source; None: the shipped kernels
    again). Objects that keep the library they were made with (TorchBackend._c) are the caller's."""
    global _swapped
    _swapped = so


def load(src: Path):
    """The kernels built from this source (ops/cpu_kernels.c, or another version of it: `xinfer-bench
    attention --baseline-kernels` times two side by side), or None where they cannot be built."""
    cc = envs.c_compiler() or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler: the CPU kernels are off")
        return None
    try:
        so = _build(cc, Path(src))
    except OSError as e:  # an unwritable cache folder, a mount that refuses to map code, ...
        log.info("the CPU kernels could not be built or loaded (%s): torch paths only", e)
        return None
    if so is None:
        return None
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    so.xinfer_q4_mm.argtypes = [p, p, p, p, p, i, i, i, i, p, p, p, p]
    so.xinfer_panels.argtypes = [p, p, p, i, i, i, p, p, p]
    so.xinfer_panels8.argtypes = [p, p, p, i, i, i, p, p, p]
    so.xinfer_q8_mm.argtypes = [p, p, p, i, p, p, i, i, i, i, p, p, p, p]
    so.xinfer_panels_i16.argtypes = [p, i, i, i, p]
    so.xinfer_paged_decode.argtypes = [p, ctypes.c_int64, p, p, p, p, i, p, i, p, p, i, i, i, i, i, f, i, f, i, p]
    so.xinfer_paged_prefill.argtypes = [p, ctypes.c_int64, p, p, p, p, i, p, i, p, p, p, p, i, i, i, i, i, f, i, f, i, p]
    so.xinfer_silu_mul.argtypes = [p, p, i, i, i]
    so.xinfer_add_rmsnorm.argtypes = [p, i, p, p, p, i, i, i, f, f]
    so.xinfer_rope.argtypes = [p, p, p, p, p, i, i, i, i, i, ctypes.c_int64, ctypes.c_int64]
    so.xinfer_decode.argtypes = [p, p, p, i, p, p, p, i, p]
    so.xinfer_attn_width.argtypes = []
    so.xinfer_kv_store.argtypes = [p, p, i, p, p, ctypes.c_int64, i, i, i, i, p, p, p, p]
    so.xinfer_sample.argtypes = [p, ctypes.c_int64, i, i, p, p, p]
    so.xinfer_bf16_pack.argtypes = [p, i, i, p]
    so.xinfer_bf16_mm.argtypes = [p, p, p, p, i, i, i]
    so.xinfer_qg_bytes.restype = ctypes.c_long
    so.xinfer_qg_bytes.argtypes = [i, i, i]
    so.xinfer_qg_pack.argtypes = [i, p, i, i, p]
    so.xinfer_qg_quant.argtypes = [p, i, i, p, p, p, p, p]
    so.xinfer_qg_rows.argtypes = [i, p, i, p, i, p]
    so.xinfer_qg_mm.argtypes = [i, p, i, i, p, p, p, p, p, i, p, i]
    return so


def _build(cc: str, src: Path):
    """Compile (once per source, compiler and CPU) and load the kernels; None if gcc refuses."""
    torch_lib = Path(torch.__file__).parent / "lib"
    march = envs.cpu_march() or (cpu_isa.MARCH.get(cpu_isa.level(), "native") if envs.cpu_isa() else "native")
    key = hashlib.sha256(src.read_bytes() + QGEMM.read_bytes() + cc.encode() + _cpu_id().encode() + str(torch_lib).encode()
                         + march.encode()).hexdigest()[:16]
    out = _cache_dir() / f"cpu_kernels-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        # Linking the libgomp.so.1 that torch ships makes both use one OpenMP thread pool.
        gomp = ["-L", str(torch_lib), f"-Wl,-rpath,{torch_lib}"] if (torch_lib / "libgomp.so.1").exists() else []
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_out = Path(tmp) / out.name
            # -ffp-contract=off: elementwise kernels round each step as torch does (no fused a*b+c)
            cmd = [cc, "-O3", f"-march={march}", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", str(src), str(QGEMM), "-o",
                   str(tmp_out)] + gomp
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                log.info("the CPU kernels could not be built here (%s): torch paths only",
                         (r.stderr.strip().splitlines() or ["?"])[-1][:200])
                return None
            os.replace(tmp_out, out)  # atomic: concurrent workers never load a half-written file
    return ctypes.CDLL(str(out))


def has_bf16() -> bool:
    """The block kernels were built with AVX512_BF16 dot products (--cpu-matmul bfloat16 uses them)."""
    so = lib()
    return bool(so is not None and so.xinfer_has_bf16())


def simd_width() -> int:
    """The block kernels' vector width in bits: 512 (the AVX-512 build), 256 (AVX2), 0 (none)."""
    so = lib()
    return so.xinfer_simd_width() if so is not None else 0


def attends(head_dim: int) -> bool:
    """The C decode attention takes this head size (a multiple of its vector width)."""
    so = lib()
    return so is not None and head_dim % so.xinfer_attn_width() == 0


def silu_mul(gu: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up from a gate/up projection's output [T, 2 I] (float32 or bfloat16) in one pass, or
    None where the kernels do not take it (they round a bfloat16 result once, torch twice)."""
    so = lib()
    if so is None or gu.device.type != "cpu" or gu.dim() != 2 or not gu.is_contiguous() \
            or gu.dtype not in (torch.float32, torch.bfloat16) or gu.shape[1] % (2 * so.xinfer_attn_width()):
        return None
    out = gu.new_empty(gu.shape[0], gu.shape[1] // 2)
    so.xinfer_silu_mul(gu.data_ptr(), out.data_ptr(), gu.shape[0], out.shape[1], gu.dtype == torch.bfloat16)
    return out


def sample(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """Each row of logits [B, V] drawn at its temperature with its U(0, 1) (u [B, 1]) by the inverse
    CDF of its softmax in one C call (ops/sampling.py draw's token, without the probabilities), or
    None where the kernels do not take it."""
    so = lib()
    if so is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 \
            or logits.stride(1) != 1:
        return None
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    temp, u = temperature.float().contiguous(), u.float().contiguous()
    so.xinfer_sample(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], temp.data_ptr(),
                     u.data_ptr(), out.data_ptr())
    return out


def available() -> bool:
    return lib() is not None



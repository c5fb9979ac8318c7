"""Which x86 vector units this CPU has, read once, and the matmul path each level gets.

Levels, lowest first: avx2 (AVX2 + FMA), avx512 (F/BW/VL), avx512_vnni, avx512_bf16, amx (AMX-BF16
and AMX-INT8 tiles). XINFER_CPU_ISA forces a lower level, so every path can be tested on a CPU that
has more; a level the CPU lacks is never taken (logged). What each level serves:

- decode, up to XINFER_QUANT_MAX_ROWS rows with GGUF blocks: the block kernels (ops/cpu_kernels.c,
  built for the level's -march), which read a fraction of the weight bytes;
- batched decode and prefill (more rows, or no blocks): bfloat16 GEMMs through oneDNN where the CPU
  has BF16 dot products (avx512_bf16; amx: oneDNN picks the tiles itself), else float32 GEMMs (on
  avx2 the int16 panels beat them in a loop, 1.1-1.27x, but served prefill came out slower: NOTES-cpu).
"""
from __future__ import annotations

import functools
import logging
import platform

from ops import envs

log = logging.getLogger("xinfer.cpu")

LEVELS = ("none", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx")
_NEEDS = {"avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw", "avx512vl"}, "avx512_vnni": {"avx512_vnni"},
          "avx512_bf16": {"avx512_bf16"}, "amx": {"amx_bf16", "amx_int8", "amx_tile"}}
MARCH = {"avx2": "haswell", "avx512": "skylake-avx512", "avx512_vnni": "cascadelake", "avx512_bf16": "cooperlake",
         "amx": "sapphirerapids"}  # -march for the block kernels when the level is forced


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def level_of(flags: set[str]) -> str:
    """The highest level whose flags (and every lower level's) are all present."""
    best = "none"
    for name in LEVELS[1:]:
        if not _NEEDS[name] <= flags:
            break
        best = name
    return best


@functools.lru_cache(maxsize=None)
def level() -> str:
    """This CPU's level, or the lower one XINFER_CPU_ISA asks for."""
    found = level_of(cpu_flags()) if platform.machine() in ("x86_64", "AMD64") else "none"
    want = envs.cpu_isa()
    if want is None:
        return found
    if want not in LEVELS:
        raise ValueError(f"XINFER_CPU_ISA={want!r}: one of {', '.join(LEVELS)}")
    if LEVELS.index(want) > LEVELS.index(found):
        log.warning("XINFER_CPU_ISA=%s: this CPU has only %s; using %s", want, found, found)
        return found
    return want


def has_bf16() -> bool:
    return LEVELS.index(level()) >= LEVELS.index("avx512_bf16")


def fast_matmul() -> str:
    """--cpu-matmul auto's choice for this CPU (bench/NOTES-cpu.md): bfloat16 with BF16 dot products;
    AVX2 without AVX-512: int16 activations in the block kernels; else float32."""
    return "bfloat16" if has_bf16() else "int16" if level() == "avx2" else "float32"


def block_rows(bf16_panels: bool = False) -> int:
    """The largest batch the block kernels take (XINFER_QUANT_MAX_ROWS, else where the GEMMs were
    measured to catch up, bench/NOTES-cpu.md): 64 on AVX2, whose 8-column float32 panels beat its
    float32 GEMMs there (the weights stream at a quarter of the bytes), and for weights in bfloat16
    panels below AMX (each panel rebuilt once a call whatever the rows); 16 elsewhere."""
    return envs.quant_max_rows() or (64 if level() == "avx2" or (bf16_panels and level() != "amx") else 16)


def describe(matmul: str, blocks: bool, bf16_dots: bool = False, held: bool = False, panels: bool = False) -> str:
    """The one start-up line: the level and the path that serves each kind of step. `held`: GGUF
    Q4_K / Q6_K / Q8_0 weights are held as blocks alone (ops/qgemm.py) and serve every batch; `panels`:
    so are bfloat16 weights, in panels (ops/qgemm.py Bf16Weight)."""
    if held:
        return (f"cpu {level()}: GGUF Q4_K / Q6_K / Q8_0 weights: 8-bit activations on the VNNI units, every batch; "
                f"the model's other weights: {describe(matmul, blocks, bf16_dots, panels=panels).split(': ', 1)[1]}")
    big = "bfloat16 GEMMs (16-column panels, the weights held once)" if panels else \
        "bfloat16 GEMMs (oneDNN" + (", AMX tiles)" if level() == "amx" else ")") if matmul == "bfloat16" \
        else "float32 GEMMs (oneDNN)"
    dots = " (bfloat16 dot products, 16-column panels)" if matmul == "bfloat16" and bf16_dots else \
        (" (16-bit integer activations: the blocks' own integers up to 3 rows, then the integers widened to 16"
         " bits in panels)" if level() == "avx2" else " (16-bit integer activations up to 3 rows)") if matmul == "int16" \
        else ""
    small = f"GGUF block kernels{dots} up to {block_rows(matmul == 'bfloat16' and bf16_dots)} rows, then " if blocks else ""
    return f"cpu {level()}: decode {small}{big}; batched decode and prefill: {big}"

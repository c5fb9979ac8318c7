"""KV cache storage formats (--kvcache-dtype): what a cache tensor holds and how it is written and read.

auto keeps K/V in the model dtype; bf16 and fp16 are plain casts. fp8 (e4m3, the default, or e5m2)
stores one byte a value and a float32 scale per token and KV head: the head vector's largest magnitude
over the format's largest finite value, computed as the token is written. Scales per token-head need no
calibration pass, never clip, and make a cache slot's bytes a function of its own token's K/V alone
(no state shared across tokens or requests), so prefix-cache reuse and recompute after preemption need
nothing of their own. They cost 4 bytes a head vector (a 64-value head: 68 bytes against 128 in bf16).

The scales live in a [num_blocks, block_size, num_kv_heads] float32 tensor attached to the cache tensor
as `kv_scale`: the attention layers hand backends the cache tensor alone, and MLA's one shared cache
(v_cache is k_cache) then shares its scales too. Readers dequantize only the rows they read.

turbo8 / turbo4 / turbo3 (ops/turbo_quant.py): rotated, Lloyd-Max coded vectors of b bits a value and a
float16 length; their cache holds packed bytes (uint8, `kv_turbo` says how), read and written by the
torch backend and, on the CPU, by the C decode attention and the one-call C decode step; read by the
Triton kernel (written there by torch).
"""
from __future__ import annotations

import torch

from ops import turbo_quant

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": E4M3, "fp8_e4m3": E4M3, "fp8_e5m2": E5M2}
FP8 = (E4M3, E5M2)
SCALE_BYTES = 4
# The C kernels' names for the formats (ops/cpu_kernels.c, xq_kv); turbo caches (uint8) are 5
C_KINDS = {torch.float32: 0, E4M3: 1, E5M2: 2, torch.bfloat16: 3, torch.float16: 4}
TURBO_KIND = 5


def storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype | str:
    """The cache's torch dtype, or a turbo format's name."""
    return model_dtype if name == "auto" else name if name in turbo_quant.BITS else FORMATS[name]


def check_backend(name: str, dtype, model_dtype: torch.dtype, backend: str) -> None:
    """A start-up error where the attention backend cannot read the cache format."""
    if isinstance(dtype, str) and backend not in ("torch", "triton"):
        raise ValueError(f"--kvcache-dtype {name} runs on the torch and triton attention backends, not {backend}")
    if backend == "flashinfer" and dtype != model_dtype:
        raise ValueError(f"--kvcache-dtype {name} runs on the torch and triton attention backends, not flashinfer "
                         f"(its fp8 takes one scale a tensor; ours, one a head vector)")


def head_bytes(head_dim: int, dtype) -> int:
    """Bytes one cached head vector takes, its scale included."""
    if isinstance(dtype, str):
        return turbo_quant.head_bytes(head_dim, dtype)
    return head_dim * dtype.itemsize + (SCALE_BYTES if dtype in FP8 else 0)


def alloc(shape: tuple, dtype, device) -> torch.Tensor:
    if isinstance(dtype, str):
        return turbo_quant.alloc(shape, dtype, device)
    cache = torch.zeros(shape, dtype=dtype, device=device)
    if dtype in FP8:
        cache.kv_scale = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
    return cache


def scales(cache: torch.Tensor) -> torch.Tensor | None:
    return getattr(cache, "kv_scale", None)


def c_kind(cache: torch.Tensor) -> int | None:
    """What the C decode attention calls the cache's format, or None where it cannot read it."""
    return TURBO_KIND if hasattr(cache, "kv_turbo") else C_KINDS.get(cache.dtype)


def turbo_args(k_cache: torch.Tensor) -> tuple:
    """What the C kernels need to write and read a turbo cache: (bits, levels, midpoints, rotation,
    key shift or None), float32 and contiguous; (0, None, None, None, None) for other formats."""
    turbo = getattr(k_cache, "kv_turbo", None)
    if turbo is None:
        return 0, None, None, None, None
    bits, rot, levels = turbo
    shift = getattr(k_cache, "kv_shift", None)
    return (bits, levels.contiguous(), ((levels[1:] + levels[:-1]) / 2).contiguous(), rot.contiguous(),
            None if shift is None else shift.float().contiguous())


def rotation(cache: torch.Tensor) -> torch.Tensor | None:
    """A turbo cache's rotation: its rows are read in the rotated frame."""
    turbo = getattr(cache, "kv_turbo", None)
    return None if turbo is None else turbo[1]


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (fp8 values [..., D], float32 scales [...]) with x ~ values * scales."""
    fmax = torch.finfo(dtype).max
    amax = x.abs().amax(-1).float()
    scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))  # an all-zero vector: any scale
    return (x.float() / scale[..., None]).clamp(-fmax, fmax).to(dtype), scale


def store(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write x [T, H, D] at the flat slots (block * block_size + offset)."""
    nb, bs, h, d = cache.shape
    s, turbo = scales(cache), getattr(cache, "kv_turbo", None)
    if s is None:
        cache.view(nb * bs, h, d).index_copy_(0, slots, x.to(cache.dtype))
        return
    if turbo is not None:
        bits, rot, levels = turbo
        calib = getattr(cache, "kv_calib", None)
        if calib is not None:  # calibrating the key shift (turbo_quant.calibrate_key_shift): sum what passes
            calib[0], calib[1] = calib[0] + x.float().sum(0), calib[1] + x.shape[0]
        shift = getattr(cache, "kv_shift", None)
        q, n = turbo_quant.quantize(x if shift is None else x - shift, bits, rot, levels)
        cache.view(nb * bs, h, d).index_copy_(0, slots, q)
        s.view(nb * bs, h).index_copy_(0, slots, n)
        return
    q, sc = quantize(x, cache.dtype)
    # index_copy_ has no float8 kernel on every device: copy the bytes
    cache.view(torch.uint8).view(nb * bs, h, d).index_copy_(0, slots, q.view(torch.uint8))
    s.view(nb * bs, h).index_copy_(0, slots, sc)


def copy(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the rows at flat slots `src` to `dst`, as stored (scales too)."""
    nb, bs, h, d = cache.shape
    rows = cache.view(torch.uint8) if cache.dtype in FP8 else cache  # no float8 index kernels everywhere
    rows.view(nb * bs, h, d).index_copy_(0, dst, rows.view(nb * bs, h, d)[src])
    s = scales(cache)
    if s is not None:
        s.view(nb * bs, h).index_copy_(0, dst, s.view(nb * bs, h)[src])


def gather(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows at `slots` (any shape of flat slots) as [*slots.shape, H, D] in dtype (turbo: rotated)."""
    nb, bs, h, d = cache.shape
    s, turbo = scales(cache), getattr(cache, "kv_turbo", None)
    if s is None:
        return cache.view(nb * bs, h, d)[slots].to(dtype)
    if turbo is not None:
        rows = turbo_quant.rotated_rows(cache.view(nb * bs, h, d)[slots], s.view(nb * bs, h)[slots], turbo[0], turbo[2])
        return rows.to(dtype)
    rows = cache.view(torch.uint8).view(nb * bs, h, d)[slots].view(cache.dtype)
    return (rows.float() * s.view(nb * bs, h)[slots][..., None]).to(dtype)

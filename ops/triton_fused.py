"""Fused elementwise kernels for the GPU: residual add + RMSNorm, the gated activation (SiLU or
tanh-GELU times up), and rotary embedding in place. Each replaces a chain of small torch ops (eight
for a norm, about ten for rotary) with one launch and one pass over memory, which is most of a
decode step's kernel count once the GEMMs are few and large.

Each computes in float32 and rounds where the torch path rounds (ops/norm.py, ops/rotary.py,
models/layers.py), so both agree to the last bit or two. They run on CUDA tensors; on the CPU under
the Triton interpreter when XINFER_TRITON_OPS=1 (tests).
"""
from __future__ import annotations

import functools

import torch

from ops import envs


@functools.cache
def _triton():
    try:
        import triton  # noqa: F401
        return True
    except ImportError:
        return False


def enabled(x: torch.Tensor) -> bool:
    """Whether x's op runs here: on CUDA with Triton installed, or anywhere under XINFER_TRITON_OPS=1."""
    return (x.is_cuda or envs.triton_ops()) and _triton()


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def add_rmsnorm(x_ptr, r_ptr, w_ptr, out_ptr, n, sx, sr, so, eps, offset,
                    HAS_RES: tl.constexpr, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0)
        if HAS_RES:  # the sum rounds to the residual's dtype, as torch's add does, and is kept
            x = (x.to(tl.float32) + tl.load(r_ptr + row * sr + cols, mask=mask, other=0.0).to(tl.float32))
            x = x.to(r_ptr.dtype.element_ty)
            tl.store(r_ptr + row * sr + cols, x, mask=mask)
        xf = x.to(tl.float32)
        y = xf * (1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps))
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        if OFFSET:  # Gemma: (1 + w) in float32, then rounded
            y = y * (offset + w.to(tl.float32))
        else:  # w times the normalised row rounded to the dtype first, as ops/norm.py
            y = y.to(out_ptr.dtype.element_ty).to(tl.float32) * w.to(tl.float32)
        tl.store(out_ptr + row * so + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def gated_act(x_ptr, out_ptr, n, sx, so, GELU: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        g = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * sx + n + cols, mask=mask, other=0.0)
        if GELU:
            inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            a = 0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
        else:
            a = g / (1.0 + tl.exp(-g))
        a = a.to(out_ptr.dtype.element_ty).to(tl.float32)  # torch rounds the activation, then multiplies
        tl.store(out_ptr + row * so + cols, (a * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def rotary(x_ptr, pos_ptr, cos_ptr, sin_ptr, sx_t, sx_h, s_cos, HALF: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        p = tl.load(pos_ptr + t).to(tl.int64)
        i = tl.arange(0, BLOCK)
        mask = i < HALF
        c = tl.load(cos_ptr + p * s_cos + i, mask=mask, other=0.0)
        s = tl.load(sin_ptr + p * s_cos + i, mask=mask, other=0.0)
        base = x_ptr + t * sx_t + h * sx_h
        x1 = tl.load(base + i, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + i, mask=mask, other=0.0).to(tl.float32)
        tl.store(base + i, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=mask)
        tl.store(base + HALF + i, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=mask)

    return add_rmsnorm, gated_act, rotary


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, offset: float):
    """RMSNorm of rows x [..., D] (plus `residual`, which then holds the sum): ops/norm.py's result."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    r2 = residual.view(-1, shape[-1]) if residual is not None else x2
    _kernels()[0][(x2.shape[0],)](x2, r2, weight, out, shape[-1], x2.stride(0), r2.stride(0), out.stride(0), eps,
                                  float(offset), HAS_RES=residual is not None, OFFSET=bool(offset),
                                  BLOCK=_pow2(shape[-1]))
    return out.view(shape)


def gated_act(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    """act(gate) * up of x [T, 2I] (gate first): [T, I]."""
    n = x.shape[-1] // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    block = min(1024, _pow2(n))
    _kernels()[1][(x.shape[0], -(-n // block))](x, out, n, x.stride(0), out.stride(0), GELU=gelu, BLOCK=block)
    return out


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int) -> None:
    """Rotate the first rot_dim dims of each head of x [T, H, D] in place (the halves layout)."""
    if x.shape[0] == 0:
        return
    assert x.stride(-1) == 1 and cos.stride(-1) == 1
    _kernels()[2][(x.shape[0], x.shape[1])](x, positions, cos, sin, x.stride(0), x.stride(1), cos.stride(0),
                                            HALF=rot_dim // 2, BLOCK=_pow2(rot_dim // 2))

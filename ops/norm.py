"""RMSNorm, computed in float32 as the reference implementations do; on a CPU with the C kernels
(ops/cpu_kernels.py), float32 rows go through one fused call, with the residual add."""
from __future__ import annotations

import torch

from ops import triton_fused
from ops.cpu_kernels import lib


def _can_fuse(x: torch.Tensor, bf16: bool = False) -> bool:
    return (x.dtype == torch.float32 or (bf16 and x.dtype == torch.bfloat16)) and x.device.type == "cpu" \
        and x.dim() == 2 and x.is_contiguous() and lib() is not None


class RMSNorm(torch.nn.Module):
    """`offset=1.0` gives Gemma's (1 + weight) scaling."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_fused.enabled(x):
            return triton_fused.add_rmsnorm(x, None, self.weight, self.eps, self.offset)
        if _can_fuse(x):
            return self._fused(x, None)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.float())).to(dtype)
        return self.weight * xf.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None, out_bf16: bool = False):
        """(norm(x + residual), x + residual), the sum written into `residual`; None: (norm(x), x).
        With a float32 residual, x may be bfloat16 (a bfloat16 GEMM's output, widened exactly).
        `out_bf16`: the output may come in bfloat16, rounded once (for a GEMM that rounds its input
        to bfloat16 anyway): the C kernel does both without the casts."""
        if triton_fused.enabled(x) and (residual is None or residual.is_contiguous()):
            return triton_fused.add_rmsnorm(x, residual, self.weight, self.eps, self.offset), \
                (x if residual is None else residual)
        if _can_fuse(x, bf16=residual is not None) and (residual is None or _can_fuse(residual)):
            return self._fused(x, residual, out_bf16), (x if residual is None else residual)
        residual = x if residual is None else x + residual
        return self(residual), residual

    def _fused(self, x, residual, out_bf16=False):
        out = torch.empty(x.shape, dtype=torch.bfloat16 if out_bf16 else torch.float32)
        lib().xinfer_add_rmsnorm(x.data_ptr(), x.dtype == torch.bfloat16, 0 if residual is None else residual.data_ptr(),
                                 self.weight.data_ptr(), out.data_ptr(), out_bf16, x.shape[0], x.shape[1], self.eps,
                                 self.offset)
        return out

"""RMSNorm, computed in float32 as the reference implementations do."""
from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    """`offset=1.0` gives Gemma's (1 + weight) scaling."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.float())).to(dtype)
        return self.weight * xf.to(dtype)

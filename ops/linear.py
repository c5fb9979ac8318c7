"""y = x W^T (+ b), the one matmul entry point of the models.

On CPU in float32, oneDNN's GEMM beats MKL's sgemm on the AMD machines measured here (lm_head
49152x576: 11 vs 22 ms at one row, 46 vs 84 ms at 64 rows, 2 threads; see bench/NOTES-cpu.md);
XINFER_ONEDNN=0 goes back to MKL for comparisons. A weight that also has GGUF blocks
(ops/quant.py) sends small batches to the quantized kernels, which read a fraction of the bytes.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

from ops.quant import MAX_ROWS
from xinfer import envs

_ONEDNN = (envs.onednn() and torch.backends.mkldnn.is_available()
           and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, blocks=None) -> torch.Tensor:
    if blocks is not None and 0 < x.shape[0] <= MAX_ROWS and x.dim() == 2 and x.dtype == torch.float32:
        y = blocks(x)
        return y if bias is None else y.add_(bias)
    if _ONEDNN and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.shape[0] > 0:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)

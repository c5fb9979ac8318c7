"""y = x W^T (+ b), the one matmul entry point of the models.

On CPU in float32, oneDNN's GEMM beats MKL's sgemm on the AMD machines measured here (lm_head
49152x576: 11 vs 22 ms at one row, 46 vs 84 ms at 64 rows, 2 threads; see bench/NOTES-cpu.md);
XINFER_ONEDNN=0 goes back to MKL for comparisons. A weight that also has GGUF blocks
(ops/quant.py) sends small batches to the quantized kernels, which read a fraction of the bytes;
with --cpu-matmul bfloat16 the rest runs on a bfloat16 copy of the weight (activations rounded to
bfloat16, float32 accumulation and output): 2-6x float32's GEMM speed on AVX512_BF16 (bench/NOTES-cpu.md).
That copy, and in float32 the weight of a Linear that has blocks, is packed once into oneDNN's own
layout (`pack`): a plain weight is reordered on every call, which cost a 64-row decode step a third of
its GEMM time (bench/NOTES-cpu.md).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ops import envs

# oneDNN and ideep (torch's layer over it) each keep every primitive they build, up to 1,024, keyed by
# the row count too; a server's prefill steps each bring their own, so a worker's heap grew ~800 MB in
# ten minutes of varied prompts (bench/NOTES-cpu.md). 64 holds a step's few shapes and a decode batch's
# (a miss costs ~1-3 ms) and kept that soak within ~80 MB. Both are read at the first primitive built.
CACHE_CAPACITY = "64"
for _var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_var, CACHE_CAPACITY)

_ONEDNN = (envs.onednn() and torch.backends.mkldnn.is_available()
           and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A weight [N, K] in `dtype` as `linear` reads it as `fast`: in oneDNN's blocked layout where
    oneDNN is on (identical results, no reorder per call), else a plain tensor."""
    w = w.detach().to(dtype).contiguous()
    if not _ONEDNN or w.device.type != "cpu" or w.dim() != 2 or not w.numel():
        return w
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return w  # a CPU without AVX-512 (or AVX-NE-CONVERT): oneDNN has no bfloat16 layout for it
    return torch.ops.mkldnn._reorder_linear_weight(w, 64)


def nbytes(t: torch.Tensor) -> int:
    """A tensor's bytes, a packed one's too (no data pointer to read)."""
    return t.numel() * t.element_size()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, blocks=None,
           fast: torch.Tensor | None = None, out_bf16: bool = False) -> torch.Tensor:
    """`fast`: the packed weight (`pack`) for what the blocks do not take, bfloat16 with --cpu-matmul
    bfloat16 (it also takes bfloat16 activations as they are), else float32. `out_bf16`: where a
    bfloat16 `fast` runs, leave the output in bfloat16 (what the next bfloat16 GEMM reads anyway: no
    cast back and forth)."""
    held = blocks is not None and fast is None and not weight.numel()  # only as blocks (ops/qgemm.py): every batch
    if blocks is not None and (held or (0 < x.shape[0] <= blocks.max_rows and x.dim() == 2)) \
            and x.dtype in (torch.float32, torch.bfloat16):
        y = blocks(x.reshape(-1, x.shape[-1]).float()).view(*x.shape[:-1], -1)
        return y if bias is None else y.add_(bias)
    if fast is not None and x.dtype in (torch.float32, torch.bfloat16):
        x = x.to(fast.dtype)
        if fast.is_mkldnn:
            y = (torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), fast, None, "none", [], "")
                 .view(*x.shape[:-1], fast.shape[0]) if x.numel() else x.new_empty(*x.shape[:-1], fast.shape[0]))
        else:
            y = F.linear(x, fast)
        if out_bf16 and bias is None:
            return y
        y = y.float()
        return y if bias is None else y.add_(bias)
    if _ONEDNN and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.shape[0] > 0:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)

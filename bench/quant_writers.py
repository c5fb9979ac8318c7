"""Writers of quantized checkpoint formats, each from its definition: the tests hold xinfer's
loaders to them (tests/test_quantized.py, tests/test_quant_formats.py), and `xinfer-bench formats`
writes a real model in each format with them. Plain round-to-nearest quantizers (min-max per group),
not the calibrated GPTQ / AWQ searches: the bytes are the format's, the accuracy a floor."""
from __future__ import annotations

import numpy as np
import torch

from xinfer.loader.dequant import E2M1

POS = torch.tensor(E2M1[:8])


def pack_rows(q: np.ndarray, bits: int) -> np.ndarray:
    """GPTQ qweight: values along axis 0, 32 / bits to an int32, the first in the lowest bits."""
    per = 32 // bits
    out = np.zeros((q.shape[0] // per, q.shape[1]), dtype=np.uint32)
    for i in range(per):
        out |= q[i::per].astype(np.uint32) << np.uint32(bits * i)
    return out.view(np.int32)


def pack_cols(q: np.ndarray, bits: int, order=None) -> np.ndarray:
    """Along axis 1; AWQ puts column order[i] of each group in bit slot i."""
    per = 32 // bits
    order = order or list(range(per))
    out = np.zeros((q.shape[0], q.shape[1] // per), dtype=np.uint32)
    for i in range(per):
        out |= q[:, order[i]::per].astype(np.uint32) << np.uint32(bits * i)
    return out.view(np.int32)


def int_quant(w: torch.Tensor, bits: int, group: int, perm=None):
    """Asymmetric min-max quantization of W^T [in, out] per group of input rows (after `perm`, the
    act-order permutation: input row perm[j] goes to group j // group). Returns q, zeros, scales,
    g_idx and the float W it stands for."""
    wt = w.t().contiguous().numpy().astype(np.float64)
    k, n = wt.shape
    perm = np.arange(k) if perm is None else perm
    g_idx = np.empty(k, dtype=np.int32)
    g_idx[perm] = np.arange(k) // group
    top = (1 << bits) - 1
    scales, zeros = np.empty((k // group, n), np.float16), np.empty((k // group, n), np.int64)
    for g in range(k // group):
        rows = wt[g_idx == g]
        lo, hi = rows.min(0), rows.max(0)
        scales[g] = np.maximum((hi - lo) / top, 1e-6)
        zeros[g] = np.clip(np.round(-lo / scales[g].astype(np.float64)), 0, top)
    s, z = scales.astype(np.float64)[g_idx], zeros[g_idx]
    q = np.clip(np.round(wt / s) + z, 0, top).astype(np.int64)
    deq = torch.from_numpy(((q - z) * s).T.astype(np.float32)).contiguous()
    return q, zeros, scales, g_idx, deq


def codes(x):
    """The nearest E2M1 code of each value (sign in bit 3)."""
    idx = (x.abs()[..., None] - POS).abs().argmin(-1)
    return idx + 8 * (x < 0).long()


def pack(c):
    """E2M1 codes, two a byte, the first in the lower nibble."""
    return (c[..., 0::2] | (c[..., 1::2] << 4)).to(torch.uint8)


def nvfp4(w):
    """(packed, fp8 scale per 16, global) with global = amax / (448 * 6), ModelOpt's weight_scale_2."""
    n, k = w.shape
    g = w.abs().max() / (448 * 6)
    blk = w.view(n, k // 16, 16)
    scale = (blk.abs().amax(-1) / 6 / g).to(torch.float8_e4m3fn)
    q = codes(blk / (scale.float() * g).clamp(min=1e-12)[..., None]).view(n, k)
    return pack(q), scale, g.reshape(())


def mxfp4(w):
    n, k = w.shape
    blk = w.view(n, k // 32, 32)
    e = torch.ceil(torch.log2(blk.abs().amax(-1).clamp(min=1e-30) / 6)).clamp(-127, 127)
    q = codes(blk / torch.exp2(e)[..., None]).view(n, k)
    return pack(q), (e + 127).to(torch.uint8)


def pack32(q, bits, dim):
    """compressed-tensors' int32 packing: 32 / bits consecutive values along `dim`, the first lowest."""
    per = 32 // bits
    q = q.movedim(dim, -1).to(torch.int64)
    q = q.reshape(*q.shape[:-1], -1, per)
    out = sum(q[..., i] << (bits * i) for i in range(per))
    out = torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)
    return out.movedim(-1, dim).contiguous()


def wna16(w, bits, gs, symmetric, perm=None):
    """Per group of input columns (after act-order's `perm`): symmetric q in [-2^(b-1), 2^(b-1) - 1] or
    min-max with a zero point; stored as unsigned (plus 2^(b-1)). Returns the tensors and W."""
    n, k = w.shape
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm if perm is not None else torch.arange(k)] = (torch.arange(k) // gs).int()
    half, top = 1 << (bits - 1), (1 << bits) - 1
    scale, zero = torch.empty(n, k // gs), torch.zeros(n, k // gs, dtype=torch.int64)
    for g in range(k // gs):
        cols = w[:, g_idx == g]
        if symmetric:
            scale[:, g] = cols.abs().amax(1) / (half - 1)
        else:
            lo, hi = cols.amin(1), cols.amax(1)
            scale[:, g] = (hi - lo) / top
            zero[:, g] = torch.round(-lo / scale[:, g]).clamp(0, top)
    scale = scale.half().float()
    s, z = scale[:, g_idx.long()], (zero[:, g_idx.long()] if not symmetric else half)
    q = (torch.round(w / s) + z).clamp(0, top).to(torch.int64)
    parts = {"weight_packed": pack32(q, bits, 1), "weight_scale": scale.half(),
             "weight_shape": torch.tensor([n, k], dtype=torch.int32)}
    if not symmetric:
        parts["weight_zero_point"] = pack32(zero, bits, 0)
    if perm is not None:
        parts["weight_g_idx"] = g_idx
    return parts, (q - z).float() * s


def ct(fmt, weights=None):
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": {"targets": ["Linear"], "format": fmt, "weights": weights or {}}},
            "ignore": ["lm_head"]}


# name -> (quantization_config, convert(weight) -> stored tensors, the weight they stand for)

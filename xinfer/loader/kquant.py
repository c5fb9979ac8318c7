"""Q4_K and Q6_K quantizers for --isq: llama.cpp's reference algorithms (`quantize_row_q4_K_ref`,
`quantize_row_q6_K_ref` in ggml-quants.c, what `llama-quantize` runs without an importance matrix),
in numpy over many super-blocks at once.

They give the bytes the C reference gives for the same float32 input (tests/test_isq_kquant.py
compiles it and compares): every operation is the C one in float32, in the C order. Sums over a
block's weights run as a Python loop over positions (each step one vector op across all blocks), so
they add in the C loop's order, not numpy's pairwise order; `nearest_int` (add 1.5 * 2^23, keep the
low bits) is round-half-to-even, which `np.rint` is in float32.
"""
from __future__ import annotations

import numpy as np

F = np.float32
_EPS = F(1e-15)  # GROUP_MAX_EPS


def _seq_sum(terms) -> np.ndarray:
    """Sum over axis 0 in order: terms[0] + terms[1] + ..."""
    acc = terms[0].copy()
    for t in terms[1:]:
        acc += t
    return acc


def _rint(x: np.ndarray) -> np.ndarray:
    return np.rint(x).astype(np.int32)


def _qkx2(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """make_qkx2_quants (use_mad false) over columns: x, w [n, B] -> (L [n, B] int, scale [B], the_min [B])."""
    mn, mx = x.min(0), x.max(0)
    mn = np.minimum(mn, F(0))
    sum_w = _seq_sum(w)
    sum_x = _seq_sum(w * x)
    flat = mx == mn
    safe = np.where(flat, F(1), mx - mn)
    iscale = F(nmax) / safe
    scale = F(1) / iscale
    L = np.clip(_rint(iscale * (x - mn)), 0, nmax)
    diff = scale * L.astype(F) + mn - x
    best = _seq_sum(w * (diff * diff))
    for step in range(nstep + 1):  # a better fit moves `min`, and later steps start from it, as in C
        safe = np.where(flat, F(1), mx - mn)
        iscale = (F(rmin) + F(rdelta) * F(step) + F(nmax)) / safe
        la = np.clip(_rint(iscale * (x - mn)), 0, nmax)
        lf = la.astype(F)
        wl = w * lf
        sum_l, sum_l2, sum_xl = _seq_sum(wl), _seq_sum(wl * lf), _seq_sum(wl * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        Ds = np.where(ok, D, F(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / Ds
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / Ds
        pos = this_min > 0
        this_min = np.where(pos, F(0), this_min)
        with np.errstate(divide="ignore", invalid="ignore"):
            this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
        diff = this_scale * lf + this_min - x
        cur = _seq_sum(w * (diff * diff))
        take = ok & (cur < best)
        L = np.where(take, la, L)
        best = np.where(take, cur, best)
        scale = np.where(take, this_scale, scale)
        mn = np.where(take, this_min, mn)
    L = np.where(flat, 0, L)
    scale = np.where(flat, F(0), scale)
    return L, scale.astype(F), (-mn).astype(F)


def _half(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def q4_k(x: np.ndarray) -> np.ndarray:
    """[B, 256] float32 -> [B, 144] uint8: Q4_K super-blocks."""
    B = x.shape[0]
    xs = np.ascontiguousarray(x.reshape(B, 8, 32).transpose(2, 1, 0)).astype(F)  # [32, 8, B]
    sum_x2 = _seq_sum(xs * xs)
    av_x = np.sqrt(sum_x2 / F(32))
    w = av_x + np.abs(xs)
    L, scales, mins = _qkx2(xs.reshape(32, -1), w.reshape(32, -1), 15, -1.0, 0.1, 20)
    L, scales, mins = L.reshape(32, 8, B), scales.reshape(8, B), mins.reshape(8, B)
    max_scale = np.maximum(scales.max(0), F(0))
    max_min = np.maximum(mins.max(0), F(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F(63) / max_scale, F(0))
        inv_min = np.where(max_min > 0, F(63) / max_min, F(0))
    ls = np.minimum(_rint(inv_scale * scales) & 0xFF, 63)  # C: uint8_t, then MIN(63, .)
    lm = np.minimum(_rint(inv_min * mins) & 0xFF, 63)
    d, dmin = _half(max_scale / F(63)), _half(max_min / F(63))
    dd = d.astype(F) * ls.astype(F)  # [8, B]
    dm = dmin.astype(F) * lm.astype(F)
    nz = dd != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        Lr = np.clip(_rint((xs + dm) / np.where(nz, dd, F(1))), 0, 15)
    L = np.where(nz, Lr, L).astype(np.uint8)  # a zero scale keeps make_qkx2_quants' levels
    out = np.zeros((B, 144), np.uint8)
    out[:, 0:2] = d.view(np.uint8).reshape(B, 2)
    out[:, 2:4] = dmin.view(np.uint8).reshape(B, 2)
    ls, lm = ls.T.astype(np.uint8), lm.T.astype(np.uint8)  # [B, 8]
    sc = out[:, 4:16]
    sc[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    sc[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    sc[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    L = L.transpose(2, 1, 0).reshape(B, 4, 2, 32)  # [B, 256] in order, as pairs of sub-blocks
    out[:, 16:] = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(B, 128)
    return out


def _qx(x: np.ndarray, nmax: int):
    """make_qx_quants(n, nmax, x, L, rmse_type 1, no weights) over columns: x [n, B] ->
    (L [n, B] in 0 .. 2 nmax - 1, scale [B])."""
    idx = np.abs(x).argmax(0)  # the first largest magnitude, as C's strict >
    mx = np.take_along_axis(x, idx[None], 0)[0]
    amax = np.abs(mx)
    zero = amax < _EPS
    mxs = np.where(zero, F(1), mx)
    w = x * x

    def level(iscale):
        return np.clip(_rint(iscale * x), -nmax, nmax - 1)

    def sums(lv):
        lf = lv.astype(F)
        return _seq_sum(w * x * lf), _seq_sum(w * lf * lf)

    L = level(F(-nmax) / mxs)
    sumlx, suml2 = sums(L)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, F(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(F(nmax) + F(0.1) * F(step)) / mxs
        lv = level(iscale)
        sumlx, suml2 = sums(lv)
        take = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        with np.errstate(divide="ignore", invalid="ignore"):
            new = sumlx / suml2
        L = np.where(take, lv, L)
        scale = np.where(take, new, scale)
        best = np.where(take, scale * sumlx, best)
    L = np.where(zero, -nmax, L) + nmax
    return L, np.where(zero, F(0), scale).astype(F)


def q6_k(x: np.ndarray) -> np.ndarray:
    """[B, 256] float32 -> [B, 210] uint8: Q6_K super-blocks."""
    B = x.shape[0]
    xs = np.ascontiguousarray(x.reshape(B, 16, 16).transpose(2, 1, 0)).astype(F)  # [16, 16, B]
    L, scales = _qx(xs.reshape(16, -1), 32)
    L, scales = L.reshape(16, 16, B), scales.reshape(16, B)
    idx = np.abs(scales).argmax(0)
    max_scale = np.take_along_axis(scales, idx[None], 0)[0]
    empty = np.abs(max_scale) < _EPS
    iscale = F(-128) / np.where(empty, F(1), max_scale)
    d = _half(F(1) / iscale)
    q_sc = np.minimum(_rint(iscale * scales), 127).astype(np.int8)  # [16, B]
    dd = d.astype(F) * q_sc.astype(F)
    nz = dd != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        Lr = np.clip(_rint(xs / np.where(nz, dd, F(1))), -32, 31) + 32
    L = np.where(nz, Lr, L).astype(np.uint8).transpose(2, 1, 0).reshape(B, 2, 4, 32)  # [B, half, quarter, l]
    out = np.zeros((B, 210), np.uint8)
    ql = (L[:, :, 0:2] & 0xF) | ((L[:, :, 2:4] & 0xF) << 4)  # [B, 2, 2, 32]: ql[l], ql[l + 32] of each half
    qh = (L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4) | ((L[:, :, 3] >> 4) << 6)
    out[:, 0:128] = ql.reshape(B, 128)
    out[:, 128:192] = qh.reshape(B, 64)
    out[:, 192:208] = q_sc.T.view(np.uint8)
    out[:, 208:210] = d.view(np.uint8).reshape(B, 2)
    out[empty] = 0
    return out

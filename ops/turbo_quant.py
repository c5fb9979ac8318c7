"""TurboQuant-style KV vectors (--kvcache-dtype turbo8 | turbo4 | turbo3), after Zandieh et al. 2025.

Each K or V head vector x (D values) is rotated by a fixed random orthogonal matrix R, so that, whatever
x looks like (outlier channels included), y = R x / |x| is a random-looking point on the unit sphere whose
coordinates follow one known distribution, f(t) ~ (1 - t^2)^((D - 3) / 2). Each coordinate is then
coded with b bits by the Lloyd-Max quantizer of that distribution (the levels that minimise its mean
squared error), and one float16 number per vector keeps its length: the least-squares factor n with
x ~ n R^T c (c the coded levels), which is |x| (u . c) / (c . c) for u = y / |y|.

Readers never un-rotate the cache: a score q . x is (R q) . (n c), so a query is rotated once, and the
attention output sum p_t n_t R^T c_t is R^T (sum p_t n_t c_t), one rotation of the result. The rows
read are rebuilt as n c in the rotated frame (dequantized per read, never the whole cache).

Keys are stored less a per-layer, per-head channel mean mu, calibrated once at start-up on a fixed
text (calibrate_key_shift): softmax(q . (k - mu)) = softmax(q . k), since q . mu is the same for
every position, so nothing reads it back, and the smaller vectors lose less to the b bits (on the
bundled model, turbo4's KLD 0.074 -> 0.048, turbo3's 0.34 -> 0.21). Values are not shifted: adding the
mean back after attention measured worse.

Triton (ops/triton_attention.py) unpacks the codes as it loads a tile; the writes there are torch's.
On the CPU, ops/cpu_kernels.c reads these rows in its decode attention (the levels looked up eight
at a time) and writes them in its one-call decode step (turbo_write, the same codes but for a
coordinate within rounding of a midpoint, which its other order of sums may send to the next level).

R is a Haar-random orthogonal matrix from a seeded QR (any D; a dense D x D product per vector costs
what a fast Hadamard transform would not save here), the same for every layer, K and V. Indices pack 8
to b bytes. The paper's 1-bit QJL residual for keys is not applied (turbo8/4/3: b bits a coordinate).
"""
from __future__ import annotations

import functools

import torch

BITS = {"turbo8": 8, "turbo4": 4, "turbo3": 3}
NORM_BYTES = 2


@functools.cache
def rotation(d: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0x7DB0)
    q, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()  # the sign fix makes it Haar-distributed


@functools.cache
def codebook(d: int, bits: int) -> torch.Tensor:
    """The 2^bits Lloyd-Max levels (ascending) for one coordinate of a uniform point on the sphere in R^d."""
    t = torch.linspace(-1, 1, 200_001, dtype=torch.float64)[1:-1]
    w = (1 - t * t) ** ((d - 3) / 2)
    cdf = torch.cumsum(w, 0) / w.sum()
    n = 1 << bits
    levels = t[torch.searchsorted(cdf, (torch.arange(n, dtype=torch.float64) + 0.5) / n)]  # start at quantiles
    for _ in range(300):
        cell = torch.bucketize(t, (levels[1:] + levels[:-1]) / 2)
        mass = torch.zeros(n, dtype=torch.float64).index_add_(0, cell, w)
        levels = torch.zeros(n, dtype=torch.float64).index_add_(0, cell, w * t) / mass.clamp_min(1e-300)
    return ((levels - levels.flip(0)) / 2).float()  # exactly symmetric, as the density is


def head_bytes(d: int, name: str) -> int:
    return d * BITS[name] // 8 + NORM_BYTES


def alloc(shape: tuple, name: str, device) -> torch.Tensor:
    """A [*shape[:-1], packed bytes] uint8 cache with its norms (`kv_scale`, float16) and format."""
    d, bits = shape[-1], BITS[name]
    if d % 8:
        raise ValueError(f"--kvcache-dtype {name} needs a head size that is a multiple of 8, not {d}")
    cache = torch.zeros(*shape[:-1], d * bits // 8, dtype=torch.uint8, device=device)
    cache.kv_scale = torch.zeros(shape[:-1], dtype=torch.float16, device=device)
    cache.kv_turbo = (bits, rotation(d).to(device), codebook(d, bits).to(device))
    return cache


def _pack(idx: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return idx.to(torch.uint8)
    groups = idx.long().unflatten(-1, (-1, 8))  # 8 indices -> one word of 8 * bits bits -> `bits` bytes
    word = (groups << (bits * torch.arange(8, device=idx.device))).sum(-1, keepdim=True)
    return ((word >> (8 * torch.arange(bits, device=idx.device))) & 255).to(torch.uint8).flatten(-2)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return packed.long()
    groups = packed.long().unflatten(-1, (-1, bits))
    word = (groups << (8 * torch.arange(bits, device=packed.device))).sum(-1, keepdim=True)
    return ((word >> (bits * torch.arange(8, device=packed.device))) & ((1 << bits) - 1)).flatten(-2)


def quantize(x: torch.Tensor, bits: int, rot: torch.Tensor, levels: torch.Tensor):
    """x [..., D] -> (packed indices [..., D * bits / 8] uint8, float16 lengths [...])."""
    y = x.float() @ rot.T
    u = y / y.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    idx = torch.bucketize(u, (levels[1:] + levels[:-1]) / 2)
    c = levels[idx]
    n = y.norm(dim=-1) * (u * c).sum(-1) / (c * c).sum(-1).clamp_min(1e-30)
    return _pack(idx, bits), n.clamp(-65504, 65504).to(torch.float16)


def rotated_rows(packed: torch.Tensor, norms: torch.Tensor, bits: int, levels: torch.Tensor) -> torch.Tensor:
    """Rows as n c, in the rotated frame (float32)."""
    return levels[_unpack(packed, bits)] * norms.float()[..., None]


def calibrate_key_shift(layers, run) -> int:
    """Set each turbo key cache's `kv_shift` (the mean key per head and channel) from the keys that
    `run()` writes; a cache shared by K and V (MLA) is left as it is. Returns how many were set."""
    caches = [a.k_cache for a in layers if hasattr(a.k_cache, "kv_turbo") and a.k_cache is not a.v_cache]
    for c in caches:
        c.kv_calib = [0.0, 0]
    try:
        run()
    finally:
        for c in caches:
            total, count = c.kv_calib
            c.kv_calib = None
            if count:
                c.kv_shift = total / count
    return len(caches)

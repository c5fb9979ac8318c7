"""Rotary position embeddings with default, linear, llama3, longrope (Phi-3) and YaRN scaling, in HF's
"rotate half" layout or in interleaved pairs (GLM-4), over all of each head or its first rot_dim."""
from __future__ import annotations

import math

import torch

from ops import triton_fused
from ops.cpu_kernels import lib


def _kind(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"


def inv_freq(rot_dim: int, theta: float, scaling: dict | None, max_position: int = 0) -> torch.Tensor:
    """`max_position`: the context the table serves; longrope picks its factors by it."""
    # float32 throughout, exactly as the reference implementation computes it
    exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
    freqs = 1.0 / (theta ** exponents)
    kind = _kind(scaling)
    if kind == "linear":
        freqs = freqs / scaling["factor"]
    elif kind == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / freqs
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_ctx / lo, freqs / factor, freqs)
        mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
        freqs = torch.where(mid, (1 - smooth) * freqs / factor + smooth * freqs, scaled)
    elif kind in ("longrope", "su"):
        # One factor set for every position, the long one when the served context passes the pretraining
        # one (llama.cpp's rule), so no cached key was rotated by the other table. transformers picks by
        # the longest position of each forward call: the same set whenever both sit on the same side.
        long = max_position > scaling["original_max_position_embeddings"]
        ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        freqs = 1.0 / (ext * theta ** exponents)
    elif kind == "yarn":
        freqs = _yarn(rot_dim, theta, scaling, exponents)
    elif kind != "default":
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, longrope, "
                         "yarn)")
    return freqs


def _yarn(rot_dim: int, theta: float, scaling: dict, exponents: torch.Tensor) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the pretraining context are
    interpolated (divided by `factor`), those past beta_fast kept, a linear ramp between."""
    factor, orig = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(turns):  # the dimension whose frequency turns `turns` times over `orig` positions
        return rot_dim * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(theta))
    lo, hi = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, rot_dim - 1)
    if lo == hi:
        hi += 0.001
    keep = 1 - ((torch.arange(rot_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos = theta ** exponents
    return 1.0 / (factor * pos) * (1 - keep) + 1.0 / pos * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def attention_scaling(scaling: dict | None) -> float:
    """What longrope and YaRN multiply cos and sin by, as transformers does: it keeps attention as
    sharp over a context stretched `factor` times."""
    kind = _kind(scaling)
    if kind not in ("longrope", "su", "yarn"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if kind == "yarn":
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if m and m_all:
            return yarn_mscale(scaling["factor"], m) / yarn_mscale(scaling["factor"], m_all)
        return yarn_mscale(scaling["factor"])
    factor, orig = scaling["factor"], scaling["original_max_position_embeddings"]
    return math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1.0 else 1.0


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None,
                 rot_dim: int | None = None, interleaved: bool = False):
        super().__init__()
        self.rot_dim = rot_dim or head_dim
        self.interleaved = interleaved  # pairs (x0, x1), (x2, x3), ... rather than (x_i, x_i+rot_dim/2)
        f = inv_freq(self.rot_dim, theta, scaling, max_position)
        t = torch.arange(max_position, dtype=torch.float32)
        angles = torch.outer(t, f)
        scale = attention_scaling(scaling)
        self.register_buffer("cos", angles.cos() * scale, persistent=False)
        self.register_buffer("sin", angles.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hk, D]; positions [T]. With the C kernels, float32 views into the QKV
        projection's output (rows strided, heads packed) are rotated in place."""
        if (not self.interleaved and q.dtype == k.dtype == torch.float32 and q.device.type == "cpu"
                and lib() is not None and q.stride()[1:] == (q.shape[2], 1) and k.stride()[1:] == (k.shape[2], 1)
                and positions.dtype == torch.int64 and positions.is_contiguous()):
            lib().xinfer_rope(q.data_ptr(), k.data_ptr(), self.cos.data_ptr(), self.sin.data_ptr(), positions.data_ptr(),
                              q.shape[0], q.shape[1], k.shape[1], q.shape[2], self.rot_dim, q.stride(0), k.stride(0))
            return q, k
        if not self.interleaved and triton_fused.enabled(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
            triton_fused.rotary_(q, positions, self.cos, self.sin, self.rot_dim)
            triton_fused.rotary_(k, positions, self.cos, self.sin, self.rot_dim)
            return q, k
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return (_apply(q, cos, sin, self.rot_dim, self.interleaved),
                _apply(k, cos, sin, self.rot_dim, self.interleaved))


def _apply(x, cos, sin, rot_dim, interleaved=False):
    dtype = x.dtype
    xr = x[..., :rot_dim].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(dtype)
    else:
        x1, x2 = xr.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)
    if rot_dim == x.shape[-1]:
        return out
    return torch.cat((out, x[..., rot_dim:]), dim=-1)

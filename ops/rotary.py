"""Rotary position embeddings (HF "rotate half" layout) with default, linear and llama3 scaling."""
from __future__ import annotations

import math

import torch

from ops.cpu_kernels import lib


def inv_freq(rot_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    # float32 throughout, exactly as the reference implementation computes it
    freqs = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
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
    elif kind != "default":
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")
    return freqs


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None,
                 rot_dim: int | None = None):
        super().__init__()
        self.rot_dim = rot_dim or head_dim
        f = inv_freq(self.rot_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        angles = torch.outer(t, f)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hk, D]; positions [T]. With the C kernels, float32 views into the QKV
        projection's output (rows strided, heads packed) are rotated in place."""
        if (q.dtype == k.dtype == torch.float32 and q.device.type == "cpu" and lib() is not None
                and q.stride()[1:] == (q.shape[2], 1) and k.stride()[1:] == (k.shape[2], 1)
                and positions.dtype == torch.int64 and positions.is_contiguous()):
            lib().xinfer_rope(q.data_ptr(), k.data_ptr(), self.cos.data_ptr(), self.sin.data_ptr(), positions.data_ptr(),
                              q.shape[0], q.shape[1], k.shape[1], q.shape[2], self.rot_dim, q.stride(0), k.stride(0))
            return q, k
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _apply(q, cos, sin, self.rot_dim), _apply(k, cos, sin, self.rot_dim)


def _apply(x, cos, sin, rot_dim):
    dtype = x.dtype
    xr = x[..., :rot_dim].float()
    x1, x2 = xr.chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)
    if rot_dim == x.shape[-1]:
        return out
    return torch.cat((out, x[..., rot_dim:]), dim=-1)

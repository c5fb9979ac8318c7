"""The gated delta rule of Gated DeltaNet (the linear-attention layers of Qwen3-Next and Qwen3.5), in
torch for every device: a chunked form for prefill and the one-token recurrence for decode, plus the
short causal depthwise convolution in front of both.

Per head, the state S [Dk, Dv] takes each token t as
    S <- exp(g_t) S;    S <- S + k_t (beta_t (v_t - S^T k_t))^T;    o_t = S^T q_t
with q and k L2-normalised and q scaled by Dk^-1/2 (`prepare`). The chunked form gives the same
outputs and final state as running the recurrence token by token; it only reorders the sums so
that most of the work is matrix products over chunks of C tokens.

Everything here computes in float32 (the states are float32 whatever the model dtype): the decays
multiply over thousands of tokens, and bfloat16 would drift.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def prepare(q: torch.Tensor, k: torch.Tensor, v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., Hk, Dk] -> float32 [..., Hv, Dk], normalised: each key head serves Hv / Hk
    consecutive value heads."""
    r = v_heads // q.shape[-2]
    if r > 1:
        q, k = q.repeat_interleave(r, dim=-2), k.repeat_interleave(r, dim=-2)
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k


def chunked(q, k, v, g, beta, state: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """One sequence's L tokens: q, k [L, H, Dk] (from `prepare`), v [L, H, Dv], g (log decay, <= 0)
    and beta [L, H], all float32; `state` [H, Dk, Dv] float32 is read as the state before the first
    token and overwritten with the one after the last. Returns o [L, H, Dv].

    Within a chunk with start state S and cumulative decay G_t = g_1 + ... + g_t, the updates
    d_t = beta_t (v_t - mem_t) solve a unit lower-triangular system, since mem_t (what the state
    recalls for k_t) depends on the earlier d_j:
        d_t + sum_{j<t} beta_t (k_t.k_j) e^{G_t-G_j} d_j = beta_t v_t - beta_t e^{G_t} S^T k_t
    so d = U - W S with U, W the system's solutions for beta v and beta e^G k, computed for all
    chunks at once. Only the hand-over of S from chunk to chunk is sequential."""
    L, H, _ = q.shape
    n = -(-L // chunk)
    pad = n * chunk - L

    def blocks(x):  # [L, H, *] -> [H, n, C, *]; padded tokens have beta 0 and g 0: they change nothing
        x = x.transpose(0, 1)
        x = F.pad(x, (0, 0, 0, pad) if x.dim() == 3 else (0, pad))
        return x.reshape(H, n, chunk, *x.shape[2:])

    q, k, v, g, beta = (blocks(x) for x in (q, k, v, g, beta))
    G = g.cumsum(-1)  # [H, n, C]
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # e^{G_i - G_j} for j <= i; the pairs j > i would overflow, and never count
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(later, float("-inf")).exp()
    kb = k * beta[..., None]
    system = ((kb @ k.transpose(-1, -2)) * decay).tril(-1)  # unit diagonal implied
    U = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(system, kb * G.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # o_t reads d_j for j <= t, decayed to t
    q_start = q * G.exp()[..., None]  # o_t reads S decayed to t
    last = G[..., -1:]
    k_end = k * (last - G).exp()[..., None]  # d_j's contribution to the state at the chunk's end
    end_decay = last.exp()[..., None]  # [H, n, 1, 1]
    out = torch.empty_like(v)
    S = state
    for c in range(n):
        d = U[:, c] - W[:, c] @ S
        out[:, c] = q_start[:, c] @ S + scores[:, c] @ d
        S = S * end_decay[:, c] + k_end[:, c].transpose(-1, -2) @ d
    state.copy_(S)
    return out.reshape(H, n * chunk, -1)[:, :L].transpose(0, 1)


def recurrent(q, k, v, g, beta, states: torch.Tensor) -> torch.Tensor:
    """One token for each of B sequences: q, k [B, H, Dk] (from `prepare`), v [B, H, Dv], g, beta
    [B, H]; `states` [B, H, Dk, Dv] is updated in place. Returns o [B, H, Dv]."""
    states.mul_(g.exp()[..., None, None])
    recalled = torch.einsum("bhkv,bhk->bhv", states, k)
    states.add_(k[..., None] * ((v - recalled) * beta[..., None])[..., None, :])
    return torch.einsum("bhkv,bhk->bhv", states, q)


def conv_chunk(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Causal depthwise convolution of one sequence's L new rows x [L, C] after the K - 1 rows
    before them (`state` [K - 1, C], overwritten with the last K - 1 rows); weight [C, 1, K].
    Returns silu of the convolution, [L, C]."""
    K = weight.shape[-1]
    window = torch.cat([state.to(x.dtype), x])  # [K - 1 + L, C]
    state.copy_(window[window.shape[0] - (K - 1):])
    out = F.conv1d(window.t()[None], weight.to(x.dtype), groups=x.shape[1])[0].t()
    return F.silu(out)


def conv_step(x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One new row for each of B sequences: x [B, C], states [B, K - 1, C] (updated: the caller
    writes them back), weight [C, 1, K]. Returns silu of the convolution, [B, C]."""
    window = torch.cat([states.to(x.dtype), x[:, None]], dim=1)  # [B, K, C]
    states.copy_(window[:, 1:])
    return F.silu((window * weight[:, 0].t().to(x.dtype)).sum(1))

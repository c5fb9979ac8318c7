"""The layers of the Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5): the linear-attention layer with
its per-sequence recurrent state, and the output-gated full attention between them.

A linear-attention layer's state lives in `conv_state` [slots, K - 1, C] and `ssm_state`
[slots, Hv, Dk, Dv] (float32), bound by `alloc_state`; the step's AttnMetadata says which slot
each sequence owns (`state_slots`, from the scheduler: xinfer/hybrid.py). A sequence whose chunk
starts at position 0 starts from a zero state; any other chunk continues from its slot, so a
prompt cut into chunks over several steps gives what one pass would.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ops import delta_rule
from ops.attention import attend, context
from xinfer.models.layers import Attention, Linear, _param


class InProj(Linear):
    """The layer's input projections fused into one GEMM, rows [q k v | z | b | a] (Qwen3.5's
    checkpoint names: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a). Qwen3-Next stores them as
    in_proj_qkvz and in_proj_ba with the rows grouped by key head ([q_g k_g v_g z_g] for each key
    head g): shards "qkvz" and "ba" regroup them into this order as they load."""

    def __init__(self, hidden: int, key_heads: int, value_heads: int, dk: int, dv: int):
        self.hk, self.hv, self.dk, self.dv = key_heads, value_heads, dk, dv
        kd, vd = key_heads * dk, value_heads * dv
        super().__init__(hidden, [2 * kd + vd, vd, value_heads, value_heads], shards=["qkv", "z", "b", "a"])

    def _load_shard(self, param, loaded, shard):
        if shard not in ("qkvz", "ba"):
            return super()._load_shard(param, loaded, shard)
        r = self.hv // self.hk
        grouped = loaded.reshape(self.hk, -1, loaded.shape[-1])
        if shard == "ba":
            b, a = grouped.split([r, r], 1)
            parts = {"b": b, "a": a}
        else:
            q, k, v, z = grouped.split([self.dk, self.dk, r * self.dv, r * self.dv], 1)
            parts = {"qkv": torch.cat([t.reshape(-1, t.shape[-1]) for t in (q, k, v)]), "z": z}
        for name, t in parts.items():
            super()._load_shard(param, t.reshape(-1, t.shape[-1]), name)


def in_proj_target(name: str):
    """(parameter, shard) for a linear-attention input projection's checkpoint tensor, else None."""
    for src, shard in (("in_proj_qkvz", "qkvz"), ("in_proj_ba", "ba"), ("in_proj_qkv", "qkv"),
                       ("in_proj_z", "z"), ("in_proj_b", "b"), ("in_proj_a", "a")):
        if f".linear_attn.{src}.weight" in name:
            return name.replace(f".{src}.", ".in_proj."), shard
    return None


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        self.hk, self.hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        self.dk, self.dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        self.kernel = cfg["linear_conv_kernel_dim"]
        self.eps = cfg["rms_norm_eps"]
        kd, vd = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * kd + vd
        self.in_proj = InProj(h, self.hk, self.hv, self.dk, self.dv)
        self.conv1d = nn.Module()
        self.conv1d.weight = _param(self.conv_dim, 1, self.kernel)
        self.dt_bias = _param(self.hv)
        self.A_log = _param(self.hv)
        self.norm = nn.Module()  # RMSNorm over each head's output, then times silu(z)
        self.norm.weight = _param(self.dv)
        self.out_proj = Linear(vd, [h])
        self.conv_state = self.ssm_state = None  # bound by alloc_state

    def alloc_state(self, slots: int, dtype: torch.dtype, device) -> int:
        """The state pool of `slots` sequences; returns its bytes."""
        self.conv_state = torch.zeros(slots, self.kernel - 1, self.conv_dim, dtype=dtype, device=device)
        self.ssm_state = torch.zeros(slots, self.hv, self.dk, self.dv, dtype=torch.float32, device=device)
        return self.conv_state.nbytes + self.ssm_state.nbytes

    def copy_state(self, src, dst) -> None:
        """Slots `src` -> `dst` (ints, or index tensors of the same length)."""
        self.conv_state[dst] = self.conv_state[src]
        self.ssm_state[dst] = self.ssm_state[src]

    def _heads(self, mixed):
        kd = self.hk * self.dk
        q, k, v = mixed.split([kd, kd, self.hv * self.dv], -1)
        q, k = delta_rule.prepare(q.reshape(-1, self.hk, self.dk), k.reshape(-1, self.hk, self.dk), self.hv)
        return q, k, v.reshape(-1, self.hv, self.dv).float()

    def _chunk(self, qkv, g, beta, out, s: int, n: int, slot: int) -> None:
        """Rows s .. s + n of one sequence, from and into its state slot."""
        q, k, v = self._heads(delta_rule.conv_chunk(qkv[s:s + n], self.conv_state[slot], self.conv1d.weight))
        # a short piece (cut at a snapshot) in one chunk of its own length, not padded to 64
        out[s:s + n] = delta_rule.chunked(q, k, v, g[s:s + n], beta[s:s + n], self.ssm_state[slot], min(64, n))

    def forward(self, positions, x):
        meta, _ = context()
        T, kd, vd = x.shape[0], self.hk * self.dk, self.hv * self.dv
        qkv, z, b, a = self.in_proj(x).split([2 * kd + vd, vd, self.hv, self.hv], -1)
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        lens, starts = meta.query_lens, meta.query_starts
        slots = meta.state_slots if meta.state_slots is not None else list(range(len(lens)))
        snaps = meta.state_snapshots or [[] for _ in lens]  # per row: (tokens into it, snapshot slot)
        fresh = [slots[i] for i, n in enumerate(lens) if meta.kv_lens[i] == n]
        if fresh:
            idx = torch.tensor(fresh, device=x.device)
            self.conv_state[idx] = 0
            self.ssm_state[idx] = 0
        out = torch.empty(T, self.hv, self.dv, dtype=torch.float32, device=x.device)
        steps = [i for i, n in enumerate(lens) if n == 1]
        if steps:  # every one-token row in one batched update
            rows = torch.tensor([starts[i] for i in steps], device=x.device)
            sl = torch.tensor([slots[i] for i in steps], device=x.device)
            conv, ssm = self.conv_state[sl], self.ssm_state[sl]
            q, k, v = self._heads(delta_rule.conv_step(qkv[rows], conv, self.conv1d.weight))
            out[rows] = delta_rule.recurrent(q, k, v, g[rows], beta[rows], ssm)
            self.conv_state[sl], self.ssm_state[sl] = conv, ssm
            done = [(slots[i], snaps[i][0][1]) for i in steps if snaps[i]]  # a decode token ended a block
            if done:
                self.copy_state(*(torch.tensor(c, device=x.device) for c in zip(*done)))
        for i, n in enumerate(lens):
            if n > 1:  # cut where a snapshot is asked: the pieces chain their state as one pass would
                cuts = [0] + [o for o, _ in snaps[i]] + [n]
                for a, b, snap in zip(cuts, cuts[1:], [sn for _, sn in snaps[i]] + [None]):
                    if b > a:
                        self._chunk(qkv, g, beta, out, starts[i] + a, b - a, slots[i])
                    if snap is not None:
                        self.copy_state(slots[i], snap)
        o = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        o = o * self.norm.weight.float() * F.silu(z.reshape(T, self.hv, self.dv).float())
        return self.out_proj(o.reshape(T, vd).to(x.dtype))


class GatedAttention(Attention):
    """Full attention whose output is gated per channel by sigmoid(gate), the gate projected with the
    query: each head's q_proj rows are [query (D), gate (D)]. q/k norms scale by (1 + w)."""

    def __init__(self, cfg: dict, head_dim: int, rotary):
        h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        bias = cfg.get("attention_bias", False)
        super().__init__(h, heads, kv_heads, head_dim, rotary, qkv_bias=bias, o_bias=bias,
                         qk_norm_eps=cfg["rms_norm_eps"], norm_offset=1.0)
        q, kv = heads * head_dim, kv_heads * head_dim
        self.qkv_proj = Linear(h, [2 * q, kv, kv], bias=bias, shards=["q", "k", "v"])

    def forward(self, positions, x):
        t, H, Hk, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qg, k, v = self.qkv_proj(x).split([2 * H * D, Hk * D, Hk * D], -1)
        q, gate = qg.view(t, H, 2 * D).split(D, -1)
        q, k = self.q_norm(q.contiguous()), self.k_norm(k.reshape(t, Hk, D))
        q, k = self.rotary(positions, q, k)
        o = attend(q, k, v.reshape(t, Hk, D), self.k_cache, self.v_cache, self.scale)
        return self.o_proj(o.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1)))

"""Mixture-of-experts MLPs shared by the MoE families: stacked expert weights, a router whose
scoring is a parameter (softmax top-k as Qwen3-MoE; sigmoid with a correction bias and grouped
top-k as DeepSeek-V3 and GLM-4.5), optional shared experts, and one fused-experts pass."""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ops.linear import linear
from xinfer import parallel as tp
from ops.quant import QuantWeight
from xinfer.models.layers import ACTIVATIONS, GatedMLP, _param, default_loader


class Experts(nn.Module):
    """Stacked expert weights: gate_up [E, 2I, H] and down [E, H, I]. Loads both the fused
    checkpoint layout and the per-expert one (`experts.{e}.gate_proj.weight`, see `expert_target`)."""

    def __init__(self, num: int, hidden: int, inter: int):
        super().__init__()
        # tensor parallel: this rank's share of every expert's intermediate columns
        self.full, (self.start, inter) = inter, tp.part(inter)
        self.inter = inter
        self.gate_up_proj = _param(num, 2 * inter, hidden, loader=self._load)
        self.down_proj = _param(num, hidden, inter, loader=self._load)
        self.blocks = {}  # GGUF blocks per expert (--isq): {"gate_up_proj" | "down_proj": [QuantWeight] * E}

    def attach(self, name: str, q) -> None:
        """`q`: the blocks of parameter `name` with its experts stacked as rows, [E * rows, K]."""
        rows = getattr(self, name).shape[1]
        self.blocks[name] = [q.narrow(0, e * rows, rows) for e in range(getattr(self, name).shape[0])]

    def attach_stacks(self, gate=None, up=None, down=None) -> int:
        """A GGUF file's stacks in block types the kernels read, [E * I, H], [E * I, H], [E * H, I]:
        each expert's gate-up and down blocks (this rank's columns). A part missing (another type), or
        that a tensor-parallel split would cut mid-block, stays float. Returns how many parts got blocks."""
        E, I, H = self.gate_up_proj.shape[0], self.full, self.down_proj.shape[1]
        mine = (self.start, self.inter)
        try:
            if gate is not None and up is not None:
                gate_up = [QuantWeight.cat([gate.narrow(0, e * I, I).narrow(0, *mine),
                                            up.narrow(0, e * I, I).narrow(0, *mine)]) for e in range(E)]
                if all(q is not None for q in gate_up):  # None: gate and up in different block kinds
                    self.blocks["gate_up_proj"] = gate_up
            if down is not None:
                self.blocks["down_proj"] = [down.narrow(0, e * H, H).narrow(1, *mine) for e in range(E)]
        except ValueError:
            pass
        return len(self.blocks)

    def _load(self, param, loaded, shard=None):
        I, mine = self.full, (self.start, self.inter)
        if shard is None:  # the stacked layout: [E, 2I, H] (gate rows, then up) or [E, H, I]
            if param is self.down_proj:
                return default_loader(param, loaded.narrow(2, *mine))
            return default_loader(param, torch.cat([loaded[:, :I].narrow(1, *mine), loaded[:, I:].narrow(1, *mine)], 1))
        expert, part = shard
        if part == "down":
            return default_loader(param.data[expert], loaded.narrow(1, *mine))
        default_loader(param.data[expert].narrow(0, 0 if part == "gate" else self.inter, self.inter),
                       loaded.narrow(0, *mine))


_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def expert_target(name: str):
    """(parameter, shard) for a per-expert checkpoint tensor, else None (a model's `remap`)."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    return f"{m[1]}.{'down_proj' if m[3] == 'down' else 'gate_up_proj'}", (int(m[2]), m[3])


class Router(nn.Module):
    """Picks each token's top_k experts and their weights, in float32 as the references do.

    softmax: the top_k of the softmax over all experts (Qwen3-MoE, DeepSeek-V2). sigmoid (DeepSeek-V3,
    GLM-4.5): experts are chosen by sigmoid score plus `e_score_correction_bias`, the weights are the
    unbiased scores. With n_group > 1 only the `topk_group` best groups are open: by their two best
    biased scores summed (sigmoid) or their best score (softmax). The weights are optionally
    renormalized to sum to 1, then multiplied by `scale` (routed_scaling_factor)."""

    def __init__(self, num: int, hidden: int, top_k: int, scoring: str = "softmax", norm: bool = True,
                 n_group: int = 1, topk_group: int = 1, scale: float = 1.0):
        super().__init__()
        assert scoring in ("softmax", "sigmoid") and num % n_group == 0 and top_k <= num
        self.top_k, self.scoring, self.norm, self.scale = top_k, scoring, norm, scale
        self.n_group, self.topk_group = n_group, topk_group
        self.weight = _param(num, hidden)
        self.e_score_correction_bias = _param(num) if scoring == "sigmoid" else None

    def forward(self, x):
        logits = F.linear(x.float(), self.weight.float())
        sigmoid = self.scoring == "sigmoid"
        scores = logits.sigmoid() if sigmoid else torch.softmax(logits, dim=-1)
        choice = scores + self.e_score_correction_bias.float() if sigmoid else scores
        if self.n_group > 1:
            groups = choice.view(x.shape[0], self.n_group, -1)
            best = groups.topk(2, dim=-1)[0].sum(-1) if sigmoid else groups.amax(-1)
            keep = torch.zeros_like(best).scatter_(1, best.topk(self.topk_group, dim=-1)[1], 1.0)
            choice = groups.masked_fill(keep[..., None] == 0, float("-inf")).view_as(choice)
        idx = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, idx)
        if self.norm:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if sigmoid else 0.0))
        return weights * self.scale, idx


def fused_experts(x, gate_up, down, weights, idx, act=F.silu, blocks=None):
    """x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; weights, idx [T, k]. The T*k (token, expert)
    pairs sorted by expert form one contiguous run of rows per expert, so each projection is one
    grouped GEMM over those runs: every expert reads only its own tokens."""
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)  # stable: the same rows in the same order whatever the batch
    tok = order // idx.shape[1]
    # where each expert's run ends, found on the device (no host sync)
    ends = torch.searchsorted(flat[order], torch.arange(1, gate_up.shape[0] + 1, device=flat.device))
    blocks = blocks or {}
    gate, up = _grouped(x[tok], gate_up, ends, blocks.get("gate_up_proj")).chunk(2, dim=-1)
    y = _grouped(act(gate) * up, down, ends, blocks.get("down_proj")) * weights.reshape(-1)[order, None].to(x.dtype)
    return torch.zeros_like(x).index_add_(0, tok, y)


def _grouped(a, w, ends, blocks=None):
    """a [N, K] (expert e's run of rows ending at ends[e]) times w[e]^T [K, M] per run: [N, M].
    `blocks`: each expert's GGUF blocks, which runs of few rows read instead (a decode step's)."""
    if blocks is None and _grouped_mm_fits(a, w):
        return F.grouped_mm(a, w.transpose(1, 2), offs=ends.to(torch.int32))
    out, start = a.new_empty(a.shape[0], w.shape[1]), 0
    for e, end in enumerate(ends.tolist()):  # fallback: one GEMM per expert that has rows
        if end > start:
            out[start:end] = linear(a[start:end], w[e], None, blocks[e] if blocks else None)
        start = end
    return out


def _grouped_mm_fits(a, w) -> bool:
    """torch's grouped GEMM runs float32 and bfloat16 on a CPU and bfloat16 on CUDA (SM 80+), with
    rows whose byte strides are multiples of 16."""
    if not hasattr(F, "grouped_mm") or a.shape[0] == 0:
        return False
    if a.device.type == "cpu":
        ok_dtype = a.dtype in (torch.float32, torch.bfloat16)
    else:
        ok_dtype = a.dtype == torch.bfloat16 and a.device.type == "cuda" and torch.cuda.get_device_capability()[0] >= 8
    size = a.element_size()
    return ok_dtype and a.dtype == w.dtype and (w.shape[1] * size) % 16 == 0 and (w.shape[2] * size) % 16 == 0


class SparseMoe(nn.Module):
    """Routed experts plus, optionally, shared experts every token runs through."""

    def __init__(self, hidden: int, inter: int, num: int, router: Router, act: str = "silu", shared_inter: int = 0):
        super().__init__()
        self.gate = router
        self.experts = Experts(num, hidden, inter)
        self.act = ACTIVATIONS[act]
        # tensor parallel: both give partial sums, reduced once
        self.shared_experts = GatedMLP(hidden, shared_inter, act, reduce=False) if shared_inter else None

    def forward(self, x):
        weights, idx = self.gate(x)
        out = fused_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, idx, self.act,
                            self.experts.blocks)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return tp.all_reduce(out)


def deepseek_mlp(cfg: dict, idx: int, scoring: str = "sigmoid") -> nn.Module:
    """Layer idx's MLP in the DeepSeek layout (GLM-4.5 too): `first_k_dense_replace` dense layers,
    then routed experts beside `n_shared_experts` shared ones. DeepSeek-V2 scores by softmax, and
    `topk_method` greedy means no groups."""
    h, act = cfg["hidden_size"], cfg.get("hidden_act", "silu")
    n = cfg.get("n_routed_experts") or 0
    kinds = cfg.get("mlp_layer_types")  # GLM-4.7-Flash says it per layer
    # an MTP depth (idx past the decoder's layers) is a MoE layer
    if (idx < len(kinds) and kinds[idx] == "dense" if kinds else idx < cfg.get("first_k_dense_replace", 1)) or not n:
        return GatedMLP(h, cfg["intermediate_size"], act)
    inter = cfg["moe_intermediate_size"]
    groups = (1, 1) if cfg.get("topk_method") == "greedy" else (cfg.get("n_group") or 1, cfg.get("topk_group") or 1)
    router = Router(n, h, cfg["num_experts_per_tok"], scoring, cfg.get("norm_topk_prob", scoring == "sigmoid"),
                    *groups, cfg.get("routed_scaling_factor", 1.0))
    return SparseMoe(h, inter, n, router, act, inter * (cfg.get("n_shared_experts") or 0))

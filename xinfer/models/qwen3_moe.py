"""Qwen3-MoE: Qwen3 attention with top-k routed experts in the MLP."""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ops.linear import linear
from xinfer.models.layers import GatedMLP, _param, default_loader
from xinfer.models.qwen3 import Qwen3ForCausalLM
from xinfer.models.registry import register


class Experts(nn.Module):
    """Stacked expert weights: gate_up [E, 2I, H] and down [E, H, I]. Loads both the fused
    checkpoint layout and the per-expert one (`experts.{e}.gate_proj.weight`)."""

    def __init__(self, num: int, hidden: int, inter: int):
        super().__init__()
        self.inter = inter
        self.gate_up_proj = _param(num, 2 * inter, hidden, loader=self._load)
        self.down_proj = _param(num, hidden, inter, loader=self._load)

    def _load(self, param, loaded, shard=None):
        if shard is None:
            return default_loader(param, loaded)
        expert, part = shard
        rows = {"gate": (0, self.inter), "up": (self.inter, self.inter), "down": (0, param.shape[1])}[part]
        default_loader(param.data[expert].narrow(0, *rows), loaded)


def num_experts(cfg: dict) -> int:
    return cfg.get("num_experts") or cfg.get("num_local_experts") or 0  # transformers 5 renamed it


class SparseMoe(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.top_k, self.norm_topk = cfg["num_experts_per_tok"], cfg.get("norm_topk_prob", True)
        self.gate = nn.Module()
        self.gate.weight = _param(num_experts(cfg), cfg["hidden_size"])
        self.experts = Experts(num_experts(cfg), cfg["hidden_size"], cfg["moe_intermediate_size"])

    def forward(self, x):
        probs = torch.softmax(linear(x, self.gate.weight).float(), dim=-1)
        weights, idx = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        # Loop only over the experts this batch routes to.
        for e in idx.unique().tolist():
            tok, slot = torch.where(idx == e)
            gate, up = linear(x[tok], self.experts.gate_up_proj[e]).chunk(2, dim=-1)
            y = linear(F.silu(gate) * up, self.experts.down_proj[e]) * weights[tok, slot, None]
            out.index_add_(0, tok, y)
        return out


_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, cfg, idx):
        sparse = (idx not in cfg.get("mlp_only_layers", []) and num_experts(cfg) > 0
                  and (idx + 1) % cfg.get("decoder_sparse_step", 1) == 0)
        if sparse:
            return SparseMoe(cfg)
        return GatedMLP(cfg["hidden_size"], cfg["intermediate_size"], cfg.get("hidden_act", "silu"))

    def remap(self, name):
        m = _EXPERT.match(name)
        if m:
            param = f"{m[1]}.{'down_proj' if m[3] == 'down' else 'gate_up_proj'}"
            return param, (int(m[2]), m[3])
        return None


register("Qwen3MoeForCausalLM", Qwen3MoeForCausalLM)

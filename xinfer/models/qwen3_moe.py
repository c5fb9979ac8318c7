"""Qwen3-MoE: Qwen3 attention with softmax top-k routed experts in the MLP."""
from __future__ import annotations

from xinfer.models.layers import GatedMLP
from xinfer.models.moe import Router, SparseMoe, expert_target
from xinfer.models.qwen3 import Qwen3ForCausalLM
from xinfer.models.registry import register


def num_experts(cfg: dict) -> int:
    return cfg.get("num_experts") or cfg.get("num_local_experts") or 0  # transformers 5 renamed it


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    cuda_graphs = False  # routing sorts rows by expert: data-dependent shapes
    def make_mlp(self, cfg, idx):
        sparse = (idx not in cfg.get("mlp_only_layers", []) and num_experts(cfg) > 0
                  and (idx + 1) % cfg.get("decoder_sparse_step", 1) == 0)
        act = cfg.get("hidden_act", "silu")
        if not sparse:
            return GatedMLP(cfg["hidden_size"], cfg["intermediate_size"], act)
        n, h = num_experts(cfg), cfg["hidden_size"]
        router = Router(n, h, cfg["num_experts_per_tok"], "softmax", cfg.get("norm_topk_prob", True))
        return SparseMoe(h, cfg["moe_intermediate_size"], n, router, act)

    def remap(self, name):
        return expert_target(name)


register("Qwen3MoeForCausalLM", Qwen3MoeForCausalLM)

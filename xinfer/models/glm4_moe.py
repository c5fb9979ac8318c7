"""GLM-4.5 / 4.6 MoE: Llama-style layers with biased Q/K/V (o_proj unbiased), optional q/k norms,
rotary on the first half of each head in HF's half-split layout, `first_k_dense_replace` dense MLPs
and then sigmoid-routed experts with a shared expert (xinfer/models/moe.py)."""
from __future__ import annotations

from xinfer.models.layers import Attention
from xinfer.models.llama import LlamaForCausalLM
from xinfer.models.moe import deepseek_mlp, expert_target
from xinfer.models.mtp import attach, mtp_target, without_mtp
from xinfer.models.registry import register


class Glm4MoeForCausalLM(LlamaForCausalLM):
    cuda_graphs = False  # routing sorts rows by expert: data-dependent shapes
    partial_rotary = 0.5  # transformers' default when the config does not say

    def __init__(self, cfg):
        super().__init__(cfg)
        attach(self, cfg)

    def make_attention(self, cfg, idx):
        return Attention(cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], self.head_dim,
                         self.make_rotary(cfg, idx), qkv_bias=cfg.get("attention_bias", False),
                         qk_norm_eps=cfg["rms_norm_eps"] if cfg.get("use_qk_norm") else None)

    def make_mlp(self, cfg, idx):
        return deepseek_mlp(cfg, idx)

    def remap(self, name):
        return mtp_target(self, name) or expert_target(name)

    def load_weights(self, weights):
        super().load_weights(without_mtp(weights, self.cfg["num_hidden_layers"], self.mtp is not None))


register("Glm4MoeForCausalLM", Glm4MoeForCausalLM)

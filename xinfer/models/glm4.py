"""GLM-4 (dense): Llama with RMSNorms on the attention and MLP outputs too, biased Q/K/V, a fused
gate_up_proj, and rotary on the first half of each head (partial_rotary_factor) in interleaved pairs."""
from __future__ import annotations

from torch import nn

from ops.norm import RMSNorm
from xinfer.models.layers import Attention
from xinfer.models.llama import LlamaForCausalLM
from xinfer.models.registry import register


class Glm4DecoderLayer(nn.Module):
    def __init__(self, model, cfg, idx):
        super().__init__()
        self.self_attn = model.make_attention(cfg, idx)
        self.mlp = model.make_mlp(cfg, idx)
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.input_layernorm = RMSNorm(h, eps)
        self.post_self_attn_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)  # the MLP's input norm, despite its name
        self.post_mlp_layernorm = RMSNorm(h, eps)

    def forward(self, positions, x, residual):
        h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.post_self_attn_layernorm(self.self_attn(positions, h))
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.post_mlp_layernorm(self.mlp(h)), residual


class Glm4ForCausalLM(LlamaForCausalLM):
    layer_cls = Glm4DecoderLayer
    partial_rotary = 0.5  # transformers' default for GLM-4 configs that do not say
    interleaved_rotary = True

    def make_attention(self, cfg, idx):
        return Attention(cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], self.head_dim,
                         self.make_rotary(cfg, idx), qkv_bias=cfg.get("attention_bias", True))


register("Glm4ForCausalLM", Glm4ForCausalLM)

"""Gemma 3 (text): scaled embeddings, (1 + w) RMSNorms around both sublayers, q/k norms,
GELU-tanh MLP, and interleaved sliding-window / global layers with their own rotary bases."""
from __future__ import annotations

import torch
from torch import nn

from ops.norm import RMSNorm
from xinfer.models.layers import Attention
from xinfer.models.llama import LlamaForCausalLM
from xinfer.models.registry import register


def layer_types(cfg: dict) -> list[str]:
    if cfg.get("layer_types"):
        return cfg["layer_types"]
    pattern = cfg.get("sliding_window_pattern", 6)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(cfg["num_hidden_layers"])]


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, model, cfg, idx):
        super().__init__()
        self.self_attn = model.make_attention(cfg, idx)
        self.mlp = model.make_mlp(cfg, idx)
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.input_layernorm = RMSNorm(h, eps, 1.0)
        self.post_attention_layernorm = RMSNorm(h, eps, 1.0)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, 1.0)
        self.post_feedforward_layernorm = RMSNorm(h, eps, 1.0)

    def forward(self, positions, x, residual):
        residual = x if residual is None else x + residual
        x = self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(residual)))
        residual = residual + x
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(residual))), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_cls = c_decode_layer = Gemma3DecoderLayer
    norm_offset = 1.0
    qk_norm = True

    def __init__(self, cfg):
        cfg = dict(cfg, tie_word_embeddings=cfg.get("tie_word_embeddings", True),
                   hidden_act=cfg.get("hidden_activation", cfg.get("hidden_act", "gelu_pytorch_tanh")))
        self._types = layer_types(cfg)
        super().__init__(cfg)
        self.embed_scale = cfg["hidden_size"] ** 0.5
        self.final_softcap = cfg.get("final_logit_softcapping")

    @staticmethod
    def decode_norms(layer) -> dict:
        return {"ln_in": layer.input_layernorm, "ln_post": layer.pre_feedforward_layernorm,
                "attn_out_norm": layer.post_attention_layernorm, "mlp_out_norm": layer.post_feedforward_layernorm}

    def make_rotary(self, cfg, idx, layer_type=None):
        kind = self._types[idx]
        if not cfg.get("rope_parameters"):  # transformers<5 keys: local layers have their own base
            cfg = dict(cfg, rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10000.0)},
                "full_attention": {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 1_000_000.0),
                                   **(cfg.get("rope_scaling") or {})}})
        return super().make_rotary(cfg, idx, kind)

    def make_attention(self, cfg, idx):
        window = cfg.get("sliding_window") if self._types[idx] == "sliding_attention" else None
        return Attention(cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], self.head_dim,
                         self.make_rotary(cfg, idx), qkv_bias=cfg.get("attention_bias", False),
                         o_bias=cfg.get("attention_bias", False), qk_norm_eps=cfg["rms_norm_eps"], norm_offset=1.0,
                         scale=cfg.get("query_pre_attn_scalar", self.head_dim) ** -0.5, sliding_window=window,
                         softcap=cfg.get("attn_logit_softcapping"))

    def embed(self, input_ids):
        x = self.model.embed_tokens(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def compute_logits(self, hidden):
        logits = super().compute_logits(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


register("Gemma3ForCausalLM", Gemma3ForCausalLM)

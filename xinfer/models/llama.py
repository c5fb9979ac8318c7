"""Llama (and SmolLM2): the base decoder that the other families specialise."""
from __future__ import annotations

import torch
from torch import nn

from ops.linear import linear
from ops.norm import RMSNorm
from ops.rotary import RotaryEmbedding
from xinfer.models.layers import Attention, Embedding, GatedMLP, Linear, load_weights
from xinfer.models.registry import register


def rope_params(cfg: dict, layer_type: str | None = None) -> tuple[float, dict | None]:
    """(theta, scaling) from either the transformers<5 keys or the v5 `rope_parameters`."""
    rp = cfg.get("rope_parameters")
    if rp and layer_type and layer_type in rp:
        rp = rp[layer_type]
    if rp and "rope_theta" in rp:
        kind = rp.get("rope_type", "default")
        return float(rp["rope_theta"]), (None if kind == "default" else rp)
    return float(cfg.get("rope_theta", 10000.0)), cfg.get("rope_scaling")


def max_positions(cfg: dict) -> int:
    """Rotary tables cover the engine's max_model_len (`_max_positions`), not the model's full
    context: a 128k-position table per rope setting would waste memory."""
    return cfg.get("_max_positions") or cfg.get("max_position_embeddings") or 4096


class DecoderLayer(nn.Module):
    def __init__(self, model: "LlamaForCausalLM", cfg: dict, idx: int):
        super().__init__()
        self.self_attn = model.make_attention(cfg, idx)
        self.mlp = model.make_mlp(cfg, idx)
        eps, off = cfg["rms_norm_eps"], model.norm_offset
        h = cfg["hidden_size"]
        self.input_layernorm = RMSNorm(h, eps, off)
        self.post_attention_layernorm = RMSNorm(h, eps, off)

    def forward(self, positions, x, residual):
        h, residual = self.input_layernorm.add_forward(x, residual)
        h, residual = self.post_attention_layernorm.add_forward(self.self_attn(positions, h), residual)
        return self.mlp(h), residual


class Model(nn.Module):
    def __init__(self, lm: "LlamaForCausalLM", cfg: dict):
        super().__init__()
        self.embed_tokens = Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(lm.layer_cls(lm, cfg, i) for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"], lm.norm_offset)


class LlamaForCausalLM(nn.Module):
    layer_cls = DecoderLayer
    norm_offset = 0.0
    qk_norm = False

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = cfg
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self._rotary = {}
        self.model = Model(self, cfg)
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.head_blocks = None  # the head's QuantWeight (layers.attach_blocks)
        if not self.tied:
            self.lm_head = Linear(cfg["hidden_size"], [cfg["vocab_size"]])

    # ---- hooks the families override ----
    def make_rotary(self, cfg, idx, layer_type=None):
        """One table per distinct rope setting, shared by the layers that use it."""
        theta, scaling = rope_params(cfg, layer_type)
        key = (theta, repr(scaling))
        if key not in self._rotary:
            self._rotary[key] = RotaryEmbedding(self.head_dim, max_positions(cfg), theta, scaling)
        return self._rotary[key]

    def sliding_window(self, cfg, idx):
        return None

    def make_attention(self, cfg, idx):
        bias = cfg.get("attention_bias", False)
        return Attention(cfg["hidden_size"], cfg["num_attention_heads"],
                         cfg.get("num_key_value_heads") or cfg["num_attention_heads"], self.head_dim,
                         self.make_rotary(cfg, idx), qkv_bias=bias, o_bias=bias,
                         qk_norm_eps=cfg["rms_norm_eps"] if self.qk_norm else None,
                         sliding_window=self.sliding_window(cfg, idx))

    def make_mlp(self, cfg, idx):
        return GatedMLP(cfg["hidden_size"], cfg["intermediate_size"], cfg.get("hidden_act", "silu"),
                        bias=cfg.get("mlp_bias", False))

    def embed(self, input_ids):
        return self.model.embed_tokens(input_ids)

    # ---- the forward pass ----
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed(input_ids), None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual)
        return self.model.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return linear(hidden, w, None, self.head_blocks).float()

    def head_param_name(self) -> str:
        return "model.embed_tokens.weight" if self.tied else "lm_head.weight"

    def attention_layers(self):
        return [layer.self_attn for layer in self.model.layers]

    def remap(self, name: str):
        """Model-specific checkpoint names; None falls back to the generic mapping."""
        return None

    def load_weights(self, weights) -> None:
        skip_head = self.tied
        loaded = load_weights(self, ((n, t) for n, t in weights if not (skip_head and n.startswith("lm_head."))),
                              self.remap)
        missing = [n for n, _ in self.named_parameters() if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")


register("LlamaForCausalLM", LlamaForCausalLM)

"""Qwen3-Next: a hybrid decoder, three Gated DeltaNet linear-attention layers to one output-gated full
attention (config `layer_types`), (1 + w) RMSNorms, partial rotary, and routed experts beside a
shared expert whose output a sigmoid gate scales. The linear layers' recurrent state sits in a
per-sequence state pool (xinfer/models/deltanet.py, xinfer/hybrid.py); only the full-attention
layers use the paged KV cache."""
from __future__ import annotations

import torch
from torch import nn

from ops.norm import RMSNorm
from xinfer import hybrid
from xinfer.models.deltanet import GatedAttention, GatedDeltaNet, in_proj_target
from xinfer.models.layers import GatedMLP, Linear
from xinfer.models.llama import LlamaForCausalLM
from xinfer.models.moe import Router, SparseMoe, expert_target
from xinfer.models.qwen3_moe import num_experts
from xinfer.models.registry import register


class SharedGateMoe(SparseMoe):
    """Routed experts plus one shared expert, the shared one scaled per token by
    sigmoid(shared_expert_gate(x))."""

    def __init__(self, hidden: int, inter: int, num: int, router: Router, act: str, shared_inter: int):
        super().__init__(hidden, inter, num, router, act)
        self.shared_expert = GatedMLP(hidden, shared_inter, act) if shared_inter else None
        self.shared_expert_gate = Linear(hidden, [1]) if shared_inter else None

    def forward(self, x):
        out = super().forward(x)
        if self.shared_expert is None:
            return out
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def shared_gate_moe(cfg: dict, norm: bool) -> SharedGateMoe:
    n, h = num_experts(cfg), cfg["hidden_size"]
    router = Router(n, h, cfg["num_experts_per_tok"], "softmax", norm)
    return SharedGateMoe(h, cfg["moe_intermediate_size"], n, router, cfg.get("hidden_act", "silu"),
                         cfg.get("shared_expert_intermediate_size") or 0)


class HybridLayer(nn.Module):
    """A decoder layer whose token mixer is `linear_attn` or `self_attn`, as its checkpoint names it."""

    def __init__(self, model: "Qwen3NextForCausalLM", cfg: dict, idx: int):
        super().__init__()
        self.linear = model.types[idx] == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = model.make_attention(cfg, idx)
        self.mlp = model.make_mlp(cfg, idx)
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.input_layernorm = RMSNorm(h, eps, 1.0)
        self.post_attention_layernorm = RMSNorm(h, eps, 1.0)

    def forward(self, positions, x, residual):
        h, residual = self.input_layernorm.add_forward(x, residual)
        h = (self.linear_attn if self.linear else self.self_attn)(positions, h)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class Qwen3NextForCausalLM(LlamaForCausalLM):
    layer_cls = HybridLayer
    norm_offset = 1.0
    partial_rotary = 0.25
    norm_topk = None  # None: the config's norm_topk_prob

    def __init__(self, cfg: dict):
        self.types = hybrid.layer_types(cfg)
        super().__init__(cfg)

    def make_attention(self, cfg, idx):
        return GatedAttention(cfg, self.head_dim, self.make_rotary(cfg, idx))

    def make_mlp(self, cfg, idx):
        sparse = (idx not in (cfg.get("mlp_only_layers") or []) and num_experts(cfg) > 0
                  and (idx + 1) % cfg.get("decoder_sparse_step", 1) == 0)
        if not sparse:
            return GatedMLP(cfg["hidden_size"], cfg["intermediate_size"], cfg.get("hidden_act", "silu"))
        return shared_gate_moe(cfg, cfg.get("norm_topk_prob", True) if self.norm_topk is None else self.norm_topk)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed(input_ids), None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual)
        return self.model.norm.add_forward(x, residual)[0]

    def cpu_decoder(self):
        return None  # the one-call C decode step has no linear-attention layers

    def attention_layers(self):
        return [ly.self_attn for ly in self.model.layers if not ly.linear]

    def alloc_state(self, slots: int, device) -> int:
        """The recurrent-state pool: one slot per running sequence in every linear-attention layer.
        Returns its bytes."""
        dtype = self.model.embed_tokens.weight.dtype
        return sum(ly.linear_attn.alloc_state(slots, dtype, device) for ly in self.model.layers if ly.linear)

    def copy_state(self, src: int, dst: int) -> None:
        """Every linear-attention layer's state slot `src` -> `dst` (a prefix-cache snapshot restored)."""
        for ly in self.model.layers:
            if ly.linear:
                ly.linear_attn.copy_state(src, dst)

    def remap(self, name):
        return expert_target(name) or in_proj_target(name)

    def load_weights(self, weights) -> None:
        # checkpoints carry the MTP head as `mtp.*` (GGUF: blocks after the decoder's), which nothing
        # runs for hybrids yet
        n = len(self.model.layers)
        super().load_weights((name, t) for name, t in weights if not name.startswith("mtp.")
                             and not (name.startswith("model.layers.") and int(name.split(".")[2]) >= n))


register("Qwen3NextForCausalLM", Qwen3NextForCausalLM)

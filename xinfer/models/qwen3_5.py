"""Qwen3.5 (and 3.6), dense and MoE: Qwen3-Next's hybrid decoder with the linear-attention
projections stored apart (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) and M-RoPE, which for text
(every axis at the same position) is plain partial rotary. Dense models have a SwiGLU MLP in every
layer, MoE ones routed experts (always renormalised) and a gated shared expert in every layer.

The released checkpoints are the vision-language wrapper (Qwen3_5ForConditionalGeneration): the
loader reads its `text_config` (xinfer/loader/hf.py), and the language model's weights, stored under
`model.language_model.`, load here; the vision tower's are skipped: this serves text only."""
from __future__ import annotations

from xinfer.models.layers import GatedMLP
from xinfer.models.qwen3_next import Qwen3NextForCausalLM, shared_gate_moe
from xinfer.models.registry import register

_WRAPPED = "model.language_model."


def text_weights(weights):
    for name, t in weights:
        if name.startswith(("model.visual.", "visual.")):
            continue
        yield ("model." + name[len(_WRAPPED):] if name.startswith(_WRAPPED) else name), t


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    def make_mlp(self, cfg, idx):
        return GatedMLP(cfg["hidden_size"], cfg["intermediate_size"], cfg.get("hidden_act", "silu"))

    def load_weights(self, weights) -> None:
        super().load_weights(text_weights(weights))


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    def make_mlp(self, cfg, idx):
        return shared_gate_moe(cfg, True)


register("Qwen3_5ForCausalLM", Qwen3_5ForCausalLM)
register("Qwen3_5MoeForCausalLM", Qwen3_5MoeForCausalLM)
register("Qwen3_5ForConditionalGeneration", Qwen3_5ForCausalLM)
register("Qwen3_5MoeForConditionalGeneration", Qwen3_5MoeForCausalLM)

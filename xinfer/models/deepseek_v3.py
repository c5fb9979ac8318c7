"""DeepSeek-V3 and V2, and GLM-4.7-Flash (their MLA + MoE layout): multi-head latent attention, YaRN rotary, and after
`first_k_dense_replace` dense layers, routed experts (V3: sigmoid with grouped top-k; V2: softmax)
beside shared ones (xinfer/models/moe.py).

MLA here runs the absorbed form for every query, prefill and decode alike. The paged cache stores,
per token, only the normalized KV latent [kv_lora_rank] and the rotated shared key [qk_rope_head_dim]:
one cache "head" that is both K and V (so `v_cache` is `k_cache`). Each query head's no-rope part is
mapped into latent space by kv_b_proj's key rows, attends over the latents like MQA, and the latent
output is mapped back by kv_b_proj's value rows. That equals expanding per-head K/V, which is never
materialized."""
from __future__ import annotations

import torch
from torch import nn

from ops.attention import attend
from ops.norm import RMSNorm
from ops.rotary import RotaryEmbedding, yarn_mscale
from xinfer.models.layers import Linear, _param, default_loader
from xinfer.models.llama import LlamaForCausalLM, rope_params
from xinfer.models.moe import deepseek_mlp, expert_target
from xinfer.models.mtp import attach, mtp_target, without_mtp
from xinfer.models.registry import register


class MLAttention(nn.Module):
    num_kv_heads = 1
    kv_shared = True  # the model runner binds one tensor as k_cache and v_cache

    def __init__(self, cfg: dict, rotary: RotaryEmbedding):
        super().__init__()
        h, bias = cfg["hidden_size"], cfg.get("attention_bias", False)
        self.num_heads, self.rank, self.rope = cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        self.nope, self.v_dim = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        self.head_dim = self.rank + self.rope  # the cache's
        q_dim = self.num_heads * (self.nope + self.rope)
        if cfg.get("q_lora_rank"):
            self.q_a_proj = Linear(h, [cfg["q_lora_rank"]], bias=bias)
            self.q_a_layernorm = RMSNorm(cfg["q_lora_rank"], 1e-6)  # the reference leaves these at their default eps
            self.q_b_proj = Linear(cfg["q_lora_rank"], [q_dim])
        else:
            self.q_proj = Linear(h, [q_dim])
        self.kv_a_proj_with_mqa = Linear(h, [self.rank + self.rope], bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = nn.Module()  # not a Linear: only read as the two per-head maps, never quantized
        self.kv_b_proj.weight = _param(self.num_heads * (self.nope + self.v_dim), self.rank, loader=self._load_kv_b)
        self.o_proj = Linear(self.num_heads * self.v_dim, [h], bias=bias)
        self.rotary = rotary
        self.scale = (self.nope + self.rope) ** -0.5
        _, scaling = rope_params(cfg)
        if scaling and scaling.get("mscale_all_dim"):  # YaRN sharpens the softmax as well as cos/sin
            self.scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
        self.k_cache = self.v_cache = None  # bound by the model runner

    def _load_kv_b(self, param, loaded, shard=None):
        """Whole, or as llama.cpp's converter splits it per head: k_b [H, rank, nope] and v_b [H, v, rank]."""
        if shard is None:
            return default_loader(param, loaded)
        w = param.data.view(self.num_heads, self.nope + self.v_dim, self.rank)
        if shard == "k":
            default_loader(w[:, :self.nope], loaded.transpose(1, 2))
        else:
            default_loader(w[:, self.nope:], loaded)

    def forward(self, positions, x):
        t, heads = x.shape[0], self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_proj(x)
        q_nope, q_pe = q.view(t, heads, -1).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe.reshape(t, 1, self.rope))
        w = self.kv_b_proj.weight.view(heads, self.nope + self.v_dim, self.rank)
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w[:, :self.nope])
        kv = torch.cat([self.kv_a_layernorm(latent)[:, None], k_pe], dim=-1)
        o = attend(torch.cat([q_latent, q_pe], dim=-1), kv, kv, self.k_cache, self.v_cache, self.scale)
        o = torch.einsum("thr,hvr->thv", o[..., :self.rank], w[:, self.nope:])
        return self.o_proj(o.reshape(t, heads * self.v_dim))


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    cuda_graphs = False  # routing sorts rows by expert: data-dependent shapes
    interleaved_rotary = True  # rope_interleave, the checkpoints' layout (the rotary dims come in pairs)

    def __init__(self, cfg):
        # head_dim sizes the rotary table: only the rope part of each head rotates
        cfg = dict(cfg, head_dim=cfg["qk_rope_head_dim"])
        self.interleaved_rotary = cfg.get("rope_interleave", True)
        super().__init__(cfg)
        attach(self, self.cfg)

    def make_attention(self, cfg, idx):
        return MLAttention(cfg, self.make_rotary(cfg, idx))

    def make_mlp(self, cfg, idx):
        return deepseek_mlp(cfg, idx)

    def remap(self, name):
        if (t := mtp_target(self, name)) is not None:
            return t
        if ".self_attn.q_proj." in name:  # its own weight, not a shard of a fused QKV
            return name, None
        for part in ("k", "v"):  # GGUF's split kv_b_proj (xinfer/loader/gguf_arch.py)
            if name.endswith(f".self_attn.{part}_b_proj.weight"):
                return name.replace(f".{part}_b_proj.", ".kv_b_proj."), part
        return expert_target(name)

    def load_weights(self, weights):
        super().load_weights(without_mtp(weights, self.cfg["num_hidden_layers"], self.mtp is not None))


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """The same MLA; experts scored by softmax, with no correction bias."""

    def make_mlp(self, cfg, idx):
        return deepseek_mlp(cfg, idx, "softmax")


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.7-Flash: DeepSeek-V3's MLA and routing, its dense and MoE layers listed in mlp_layer_types."""


register("DeepseekV3ForCausalLM", DeepseekV3ForCausalLM)
register("DeepseekV2ForCausalLM", DeepseekV2ForCausalLM)
register("Glm4MoeLiteForCausalLM", Glm4MoeLiteForCausalLM)

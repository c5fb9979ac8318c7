"""What each GGUF architecture means in Hugging Face terms: its HF class, the HF names of its
tensors, and the config keys that only some architectures carry (MoE routing, MLA ranks)."""
from __future__ import annotations

from xinfer.loader.gguf_hybrid import BLOCK_NAMES as HYBRID_BLOCK_NAMES
from xinfer.loader.gguf_hybrid import HYBRID_ARCHS
from xinfer.loader.gguf_hybrid import WHOLE_NAMES as HYBRID_WHOLE_NAMES

# general.architecture -> (HF class, HF model_type)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "glm4": ("Glm4ForCausalLM", "glm4"),
    "glm4moe": ("Glm4MoeForCausalLM", "glm4_moe"),
    "deepseek2": ("DeepseekV3ForCausalLM", "deepseek_v3"),
    "qwen3next": ("Qwen3NextForCausalLM", "qwen3_next"),  # the hybrids: xinfer/loader/gguf_hybrid.py
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
}

GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # MoE router
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# Gemma has four norms per layer; llama.cpp's ffn_norm is its pre-feedforward norm.
_GEMMA3 = {
    **BLOCK_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3 and GLM-4 keep HF's fused qkv / gate-up (ffn_up holds both); GLM-4 norms both sublayers' outputs.
_FUSED = {
    **BLOCK_TENSORS,
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
    "post_attention_norm": "post_self_attn_layernorm",
    "post_ffw_norm": "post_mlp_layernorm",
}
# GLM-4.5's MLP input norm is llama.cpp's post_attention_norm, as its HF name says. Its MTP depth's
# own tensors are `nextn.*` (their embedding and head copies are the model's own and not read).
_GLM4MOE = {**BLOCK_TENSORS, "post_attention_norm": "post_attention_layernorm", "nextn.eh_proj": "eh_proj",
            "nextn.enorm": "enorm", "nextn.hnorm": "hnorm", "nextn.shared_head_norm": "shared_head.norm"}
# The converter splits kv_b_proj per head into k_b (transposed) and v_b; older files keep attn_kv_b.
_DEEPSEEK2 = {
    **BLOCK_TENSORS,
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
}
_HYBRID = {**BLOCK_TENSORS, **HYBRID_BLOCK_NAMES}
ARCH_BLOCK_TENSORS = {"gemma3": _GEMMA3, "phi3": _FUSED, "glm4": _FUSED, "glm4moe": _GLM4MOE, "deepseek2": _DEEPSEEK2,
                      **{a: _HYBRID for a in HYBRID_ARCHS}}
# Stacked [n_expert, out, in] tensors, yielded one expert at a time.
EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# Tensors whose HF name replaces the GGUF suffix too.
WHOLE_TENSORS = {"exp_probs_b": "mlp.gate.e_score_correction_bias", **HYBRID_WHOLE_NAMES}

_SOFTMAX = 1  # llama.cpp's expert_gating_func (2: sigmoid)


def arch_config(arch: str, meta, cfg: dict) -> dict:
    """The config keys of MoE and MLA architectures; `meta(key, default)` reads the file's metadata."""
    a = arch + "."
    if arch == "qwen3moe":
        return dict(num_experts=meta(a + "expert_count"), num_experts_per_tok=meta(a + "expert_used_count"),
                    moe_intermediate_size=meta(a + "expert_feed_forward_length"),
                    # llama.cpp always renormalizes the top-k router weights for qwen3moe
                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    if arch not in ("glm4moe", "deepseek2"):
        return {}
    # The block count includes the multi-token-prediction layers stored after the decoder's.
    nextn = meta(a + "nextn_predict_layers", 0)
    out = dict(num_hidden_layers=cfg["num_hidden_layers"] - nextn, num_nextn_predict_layers=nextn,
               n_routed_experts=meta(a + "expert_count"), num_experts_per_tok=meta(a + "expert_used_count"),
               n_shared_experts=meta(a + "expert_shared_count", 0),
               first_k_dense_replace=meta(a + "leading_dense_block_count", 0),
               moe_intermediate_size=meta(a + "expert_feed_forward_length"),
               routed_scaling_factor=meta(a + "expert_weights_scale", 1.0),
               norm_topk_prob=bool(meta(a + "expert_weights_norm", False)),
               n_group=meta(a + "expert_group_count", 1), topk_group=meta(a + "expert_group_used_count", 1))
    if arch == "glm4moe":
        return out
    # DeepSeek-V2 files predate the gating key; llama.cpp reads its absence as softmax, as V2 scores
    if meta(a + "expert_gating_func", _SOFTMAX) == _SOFTMAX:
        out.update(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2")
    rope = meta(a + "rope.dimension_count")
    out.update(q_lora_rank=meta(a + "attention.q_lora_rank", None), kv_lora_rank=meta(a + "attention.kv_lora_rank"),
               qk_rope_head_dim=rope, qk_nope_head_dim=meta(a + "attention.key_length_mla") - rope,
               v_head_dim=meta(a + "attention.value_length_mla"), rope_interleave=True, partial_rotary_factor=1.0)
    scaling = cfg.get("rope_scaling")
    if scaling and scaling["rope_type"] == "yarn":
        # llama.cpp keeps 0.1 * mscale_all_dim and assumes mscale equal to it (cos/sin unscaled)
        m = meta(a + "rope.scaling.yarn_log_multiplier", 0.0) / 0.1
        out["rope_scaling"] = dict(scaling, mscale=m, mscale_all_dim=m,
                                   beta_fast=meta(a + "rope.scaling.yarn_beta_fast", 32.0),
                                   beta_slow=meta(a + "rope.scaling.yarn_beta_slow", 1.0))
    return out

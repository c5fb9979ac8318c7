"""GGUF files of the Gated DeltaNet hybrids (llama.cpp's `qwen3next`, `qwen35`, `qwen35moe`): their
config from the ssm.* metadata, and what llama.cpp's converter did to the tensors, undone.

The converter (conversion/qwen.py in llama.cpp) stores A_log as A = -exp(A_log) (`ssm_a`, no
suffix), dt_bias as `ssm_dt.bias`, the conv kernel squeezed to [C, K], every RMSNorm weight but the
linear-attention output norm as 1 + w, and Qwen3-Next's in_proj_qkvz split into attn_qkv (q, k, v
of all heads) and attn_gate (z). For Qwen3.5, when key heads serve several value heads each, it also
reorders the value heads from grouped by key head (g * r + j, what the model computes with) to
tiled (j * Hk + g) in every tensor indexed by value head: the V rows of in_proj_qkv and of the
conv kernel, in_proj_z, in_proj_b / a, A_log, dt_bias, and out_proj's columns.
"""
from __future__ import annotations

import numpy as np

from xinfer.errors import ModelLoadError

HYBRID_ARCHS = ("qwen3next", "qwen35", "qwen35moe")

# GGUF block tensor -> HF name inside the layer (the rest as BLOCK_TENSORS)
BLOCK_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_beta_alpha": "linear_attn.in_proj_ba",  # the name some llama.cpp revisions spell out
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# ... and those whose HF name has no .weight / .bias of its own
WHOLE_NAMES = {"ssm_a": "linear_attn.A_log", "ssm_dt": "linear_attn.dt_bias"}


def config(arch: str, meta, cfg: dict, tensor_names: set[str]) -> dict:
    """The hybrid config keys; `meta(key, default)` reads the file's metadata."""
    a = arch + "."
    if any(n.endswith(".ssm_in.weight") for n in tensor_names):
        # an early converter's fused in_proj_qkvz, whose row order nothing here pins down
        raise ModelLoadError(f"this {arch} GGUF stores the linear-attention input projection as ssm_in, which "
                             "xinfer does not read; convert with a llama.cpp that writes attn_qkv and attn_gate")
    value_heads = meta(a + "ssm.time_step_rank")
    # the block count includes the MTP layers stored after the decoder's
    layers = cfg["num_hidden_layers"] - meta(a + "nextn_predict_layers", 0)
    full = [f"blk.{i}.attn_q.weight" in tensor_names for i in range(layers)]
    out = dict(num_hidden_layers=layers, linear_conv_kernel_dim=meta(a + "ssm.conv_kernel"),
               linear_key_head_dim=meta(a + "ssm.state_size"), linear_num_key_heads=meta(a + "ssm.group_count"),
               linear_num_value_heads=value_heads,
               linear_value_head_dim=meta(a + "ssm.inner_size") // value_heads,
               full_attention_interval=meta(a + "full_attention_interval", 4),
               layer_types=["full_attention" if f else "linear_attention" for f in full])
    if arch != "qwen35":
        out.update(num_experts=meta(a + "expert_count"), num_experts_per_tok=meta(a + "expert_used_count"),
                   moe_intermediate_size=meta(a + "expert_feed_forward_length"),
                   shared_expert_intermediate_size=meta(a + "expert_shared_feed_forward_length", 0),
                   # llama.cpp renormalises the top-k weights and routes in every layer
                   norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return out


def _tiled(arch: str, cfg: dict) -> int:
    """Value heads per key head when the file stores them tiled, else 0."""
    if arch not in ("qwen35", "qwen35moe"):
        return 0
    r = cfg["linear_num_value_heads"] // cfg["linear_num_key_heads"]
    return r if r > 1 else 0


def _untile(w: np.ndarray, key_heads: int, r: int, size: int, axis: int = 0) -> np.ndarray:
    """Tiled value heads (j * Hk + g, `size` rows each) along `axis` back to grouped (g * r + j)."""
    w = np.moveaxis(w, axis, 0)
    shape = w.shape
    w = w.reshape(r, key_heads, size, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.ascontiguousarray(np.moveaxis(w, 0, axis))


def fix_rows(arch: str, cfg: dict, name: str, w: np.ndarray) -> np.ndarray:
    """Undo the value-head tiling on the rows of tensor `name` (HF name): float rows or GGUF blocks."""
    r = _tiled(arch, cfg)
    if not r or ".linear_attn." not in name:
        return w
    hk, dv = cfg["linear_num_key_heads"], cfg["linear_value_head_dim"]
    if ".in_proj_qkv." in name or ".conv1d." in name:  # q and k rows stay; the V rows after them
        qk = 2 * hk * cfg["linear_key_head_dim"]
        return np.concatenate([w[:qk], _untile(w[qk:], hk, r, dv)])
    if ".in_proj_z." in name:
        return _untile(w, hk, r, dv)
    if name.endswith((".in_proj_b.weight", ".in_proj_a.weight", ".A_log", ".dt_bias")):
        return _untile(w, hk, r, 1)
    return w


def fix_values(arch: str, cfg: dict, gguf_name: str, w: np.ndarray) -> np.ndarray:
    """The rest of the converter's changes to one float tensor (`fix_rows` done)."""
    if gguf_name.endswith("norm.weight") and not gguf_name.endswith("ssm_norm.weight"):
        return w - 1.0
    if gguf_name.endswith(".ssm_a"):
        return np.log(-w)
    if ".ssm_conv1d." in gguf_name:
        return w.reshape(w.shape[0], 1, -1)
    if ".ssm_out." in gguf_name and (r := _tiled(arch, cfg)):
        return _untile(w, cfg["linear_num_key_heads"], r, cfg["linear_value_head_dim"], axis=1)
    return w


def keeps_blocks(arch: str, cfg: dict, gguf_name: str) -> bool:
    """Whether a quantized matrix can keep its GGUF blocks: a column reorder would cut through them."""
    return not (".ssm_out." in gguf_name and _tiled(arch, cfg))

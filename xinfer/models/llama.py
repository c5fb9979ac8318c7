"""Llama (and SmolLM2): the base decoder that the other families specialise."""
from __future__ import annotations

import re

import torch
from torch import nn

from ops import cpu_decode, cpu_kernels, kv_quant
from ops.attention import context
from ops.linear import linear
from ops.norm import RMSNorm
from ops.qgemm import Bf16Weight, PackedWeight
from ops.quant import QuantWeight
from ops.rotary import RotaryEmbedding
from xinfer import parallel as tp
from xinfer.models.layers import Attention, Embedding, GatedMLP, Linear, load_weights
from xinfer.models.registry import register


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def rope_params(cfg: dict, layer_type: str | None = None) -> tuple[float, dict | None]:
    """(theta, scaling) from either the transformers<5 keys or the v5 `rope_parameters`."""
    rp = cfg.get("rope_parameters")
    if rp and layer_type and layer_type in rp:
        rp = rp[layer_type]
    if rp and "rope_theta" in rp:
        kind = rp.get("rope_type", "default")
        theta, scaling = float(rp["rope_theta"]), (None if kind == "default" else rp)
    else:
        theta, scaling = float(cfg.get("rope_theta", 10000.0)), cfg.get("rope_scaling")
    if scaling and (scaling.get("rope_type") or scaling.get("type")) in ("longrope", "su"):
        # transformers<5 Phi-3 configs keep the pretraining context beside rope_scaling; with no
        # `factor`, the stretch is max_position_embeddings over it (it sets the attention scaling)
        orig = scaling.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
        scaling = dict(scaling, original_max_position_embeddings=orig,
                       factor=scaling.get("factor") or cfg["max_position_embeddings"] / orig)
    if scaling and (scaling.get("rope_type") or scaling.get("type")) == "yarn":
        orig = scaling.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
        scaling = dict(scaling, original_max_position_embeddings=orig,
                       factor=scaling.get("factor") or cfg["max_position_embeddings"] / orig)
    return theta, scaling


def rotary_dim(cfg: dict, head_dim: int, default: float, layer_type: str | None = None) -> int:
    """How many leading dims of each head rotate: partial_rotary_factor, in either config layout."""
    rp = cfg.get("rope_parameters") or {}
    if layer_type and layer_type in rp:
        rp = rp[layer_type]
    return int(head_dim * rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default)))


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
        # the plain blocks pass bfloat16 between the norms and the bfloat16 GEMMs (--cpu-matmul
        # bfloat16): the same numbers as float32 with casts around each GEMM, without the casts
        self.bf16_io = type(self.self_attn) is Attention and type(self.mlp) is GatedMLP

    def forward(self, positions, x, residual):
        a, m, n = self.self_attn, self.mlp, x.shape[0]
        if not self.bf16_io:
            h, residual = self.input_layernorm.add_forward(x, residual)
            h, residual = self.post_attention_layernorm.add_forward(a(positions, h), residual)
            return m(h), residual
        h, residual = self.input_layernorm.add_forward(x, residual, a.qkv_proj.reads_bf16(n))
        h, residual = self.post_attention_layernorm.add_forward(a(positions, h, True), residual,
                                                                m.gate_up_proj.reads_bf16(n))
        return m(h, True), residual


class Elsewhere(nn.Module):
    """A layer another pipeline stage holds: no weights here."""


class Model(nn.Module):
    def __init__(self, lm: "LlamaForCausalLM", cfg: dict):
        super().__init__()
        # pipeline parallel: this stage's layers; the embedding on the first stage (and the last when
        # the head is tied to it), the norm on the last
        lo, hi = lm.layers_here
        tied = cfg.get("tie_word_embeddings", False)
        self.embed_tokens = Embedding(cfg["vocab_size"], cfg["hidden_size"], parallel=True) \
            if tp.first_stage() or (tied and tp.last_stage()) else None
        self.layers = nn.ModuleList(lm.layer_cls(lm, cfg, i) if lo <= i < hi else Elsewhere()
                                    for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"], lm.norm_offset) if tp.last_stage() else None


class LlamaForCausalLM(nn.Module):
    layer_cls = DecoderLayer
    c_decode_layer = DecoderLayer  # the layer whose shape the one-call C decode step computes
    norm_offset = 0.0
    qk_norm = False
    partial_rotary = 1.0  # the share of each head that rotates when the config does not say
    interleaved_rotary = False
    cuda_graphs = True  # a decode step has no data-dependent shapes (xinfer/workers/graphs.py)

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = cfg
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self._rotary = {}
        self.layers_here = tp.layer_range(cfg["num_hidden_layers"])
        self.dtype = torch.get_default_dtype()  # built under the model's dtype (loader/weights.py)
        self.model = Model(self, cfg)
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.head_blocks = None  # the head's QuantWeight (layers.attach_blocks)
        self.head_fast = None  # the head in bfloat16 (layers.attach_fast)
        self._cpu_decoder = None  # built at the first decode step that can use it; False: none fits
        if not self.tied and tp.last_stage():  # tensor parallel: this rank's rows of the vocabulary
            self.lm_head = Linear(cfg["hidden_size"], [cfg["vocab_size"]], parallel="col",
                                  take={None: tp.vocab_part(cfg["vocab_size"])[:2]})

    # ---- hooks the families override ----
    def make_rotary(self, cfg, idx, layer_type=None):
        """One table per distinct rope setting, shared by the layers that use it."""
        theta, scaling = rope_params(cfg, layer_type)
        rot = rotary_dim(cfg, self.head_dim, self.partial_rotary, layer_type)
        key = (theta, repr(scaling), rot)
        if key not in self._rotary:
            self._rotary[key] = RotaryEmbedding(self.head_dim, max_positions(cfg), theta, scaling, rot,
                                                self.interleaved_rotary)
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
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        if tp.stages() > 1:
            return self._stage_forward(input_ids, positions)
        meta, backend = context()
        if (meta is not None and meta.row_decode() is not None and backend.name == "torch"
                and input_ids.device.type == "cpu"):
            dec = self.cpu_decoder()
            if dec is not None and input_ids.shape[0] <= dec.max_rows:
                return dec(self.embed(input_ids), positions, meta)
        x, residual = self.embed(input_ids), None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual)
        return self.model.norm.add_forward(x, residual)[0]

    def _stage_forward(self, input_ids, positions):
        """Pipeline parallel: this stage's layers over the previous stage's output (the embedding on
        the first); the last stage returns the final hidden states, the others None."""
        if tp.first_stage():
            x, residual = self.embed(input_ids), None
        else:
            x, residual = tp.recv_prev(input_ids.shape[0], self.cfg["hidden_size"], self.dtype, input_ids.device)
        lo, hi = self.layers_here
        for layer in self.model.layers[lo:hi]:
            x, residual = layer(positions, x, residual)
        if not tp.last_stage():
            # the last layer's output may be bfloat16 (DecoderLayer.bf16_io); the next stage reads the model's dtype
            tp.send_next(x.to(residual.dtype), residual)
            return None
        return self.model.norm.add_forward(x, residual)[0]

    def cpu_decoder(self) -> "cpu_decode.CpuDecoder | None":
        """The one-call C decode step (ops/cpu_decode.py) where every layer fits it: this class's
        layer with SwiGLU, GGUF blocks on every linear and a KV cache the C step reads and writes
        (float32, fp8, bf16, fp16); else None."""
        layers = self.model.layers
        dec = self._cpu_decoder
        if dec and all(k is ly.self_attn.k_cache for (k, _), ly in zip(dec.caches, layers)):
            return dec
        if dec is False or not cpu_decode.ENABLED or not cpu_decode.lib() or tp.world_size() > 1:  # no collectives in C
            return None
        parts = [self._decode_layer(ly) for ly in layers]
        norms = [] if None in parts else [
            n for ly in layers for n in (*self.decode_norms(ly).values(), ly.self_attn.q_norm, ly.self_attn.k_norm)
            if n is not None] + [self.model.norm]
        if len({(n.eps, n.offset) for n in norms}) != 1:  # a layer doesn't fit, or the norms differ
            self._cpu_decoder = False
            return None
        a = layers[0].self_attn
        self._cpu_decoder = cpu_decode.CpuDecoder(parts, self.model.norm.weight, a.num_heads, a.num_kv_heads,
                                                  a.head_dim, norms[0].eps, norms[0].offset)
        return self._cpu_decoder

    @staticmethod
    def decode_norms(layer) -> dict:
        """The layer's norms as the C step applies them: ln_in before attention, ln_post (with the
        residual add) before the MLP; Gemma 3 adds attn_out_norm and mlp_out_norm."""
        return {"ln_in": layer.input_layernorm, "ln_post": layer.post_attention_layernorm}

    def _decode_layer(self, layer) -> dict | None:
        a, mlp = layer.self_attn, layer.mlp
        if type(layer) is not self.c_decode_layer or type(a) is not Attention or type(mlp) is not GatedMLP \
                or mlp.act_name not in cpu_decode.ACTS or a.rotary.interleaved or a.k_cache is None \
                or kv_quant.c_kind(a.k_cache) is None or not cpu_kernels.attends(a.head_dim):
            return None
        lins = {"qkv": a.qkv_proj, "o": a.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
        if any(not isinstance(lin.blocks, (QuantWeight, PackedWeight, Bf16Weight)) for lin in lins.values()):  # what the C step reads
            return None
        return dict({k: (lin.blocks, lin.bias) for k, lin in lins.items()}, act=mlp.act_name,
                    **{k: n.weight for k, n in self.decode_norms(layer).items()},
                    q_norm=a.q_norm.weight if a.q_norm is not None else None,
                    k_norm=a.k_norm.weight if a.k_norm is not None else None, k_cache=a.k_cache, v_cache=a.v_cache,
                    cos=a.rotary.cos, sin=a.rotary.sin, rot=a.rotary.rot_dim, window=a.sliding_window or 0,
                    scale=a.scale, softcap=a.softcap or 0.0)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        logits = linear(hidden, w, None, self.head_blocks, self.head_fast).float()
        # tensor parallel: the logits of this rank's rows of the vocabulary, then every rank's
        return logits if tp.size() == 1 else tp.gather_vocab(logits, self.cfg["vocab_size"])

    def head_param_name(self) -> str:
        return "model.embed_tokens.weight" if self.tied else "lm_head.weight"

    def attention_layers(self):
        return [layer.self_attn for layer in self.model.layers if not isinstance(layer, Elsewhere)]

    def keeps(self, name: str) -> bool:
        """Whether checkpoint tensor `name` (HF naming) belongs on this pipeline stage: the loaders
        skip the others' without reading them."""
        if tp.stages() == 1:
            return True
        m = _LAYER.match(name)
        if m:
            return self.layers_here[0] <= int(m.group(1)) < self.layers_here[1]
        if name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is not None
        return tp.last_stage()  # the final norm, the head

    def remap(self, name: str):
        """Model-specific checkpoint names; None falls back to the generic mapping."""
        return None

    def load_weights(self, weights) -> None:
        skip_head = self.tied
        loaded = load_weights(self, ((n, t) for n, t in weights
                                     if not (skip_head and n.startswith("lm_head.")) and self.keeps(n)), self.remap)
        missing = [n for n, _ in self.named_parameters() if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")


register("LlamaForCausalLM", LlamaForCausalLM)

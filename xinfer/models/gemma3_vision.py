"""Gemma 3 with images: a SigLIP encoder (patch convolution, learned positions, pre-norm blocks
with full attention over one image), the multi-modal projector (average pool of the patch grid to
mm_tokens_per_image tokens, Gemma's soft-embedding norm, a matrix into the text width), spliced
into xinfer/models/gemma3.py's text model unscaled. One image's soft tokens attend to each other
both ways in the prefill (AttnMetadata.bidirectional, from ImageData.whole)."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ops.norm import RMSNorm
from xinfer.mm.gemma3 import Gemma3Processor
from xinfer.models.gemma3 import Gemma3ForCausalLM
from xinfer.models.layers import ACTIVATIONS, Linear
from xinfer.models.registry import register

# checkpoint prefixes of both transformers layouts (before 4.52, and since) -> this module's
RENAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
           ("language_model.lm_head.", "lm_head."), ("model.vision_tower.vision_model.", "vision_tower."),
           ("vision_tower.vision_model.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector."))


def renamed(weights, renames=RENAMES, skip=()):
    for name, t in weights:
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        if not name.startswith(skip):
            yield name, t


class SiglipBlock(nn.Module):
    def __init__(self, v: dict):
        super().__init__()
        d, eps = v["hidden_size"], v.get("layer_norm_eps", 1e-6)
        self.heads = v["num_attention_heads"]
        self.layer_norm1 = nn.LayerNorm(d, eps=eps)
        self.layer_norm2 = nn.LayerNorm(d, eps=eps)
        self.self_attn, self.mlp = nn.Module(), nn.Module()
        self.self_attn.qkv_proj = Linear(d, [d, d, d], bias=True, shards=["q", "k", "v"])
        self.self_attn.out_proj = Linear(d, [d], bias=True)
        self.mlp.fc1 = Linear(d, [v["intermediate_size"]], bias=True)
        self.mlp.fc2 = Linear(v["intermediate_size"], [d], bias=True)
        self.act = ACTIVATIONS[v.get("hidden_act", "gelu_pytorch_tanh")]

    def forward(self, x):  # [images, patches, d]: every image has the same grid
        b, n, d = x.shape
        h = self.layer_norm1(x).reshape(b * n, d)
        a, mlp = self.self_attn, self.mlp
        q, k, v = a.qkv_proj(h).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b * n, d)
        x = x + a.out_proj(o).view(b, n, d)
        h = self.layer_norm2(x).reshape(b * n, d)
        return x + mlp.fc2(self.act(mlp.fc1(h))).view(b, n, d)


class SiglipVision(nn.Module):
    def __init__(self, v: dict):
        super().__init__()
        d, p = v["hidden_size"], v.get("patch_size", 14)
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Conv2d(v.get("num_channels", 3), d, p, stride=p)
        self.embeddings.position_embedding = nn.Embedding((v["image_size"] // p) ** 2, d)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(SiglipBlock(v) for _ in range(v["num_hidden_layers"]))
        self.post_layernorm = nn.LayerNorm(d, eps=v.get("layer_norm_eps", 1e-6))

    def forward(self, pixels):  # [images, 3, H, W] -> [images, patches, d]
        e = self.embeddings
        x = e.patch_embedding(pixels).flatten(2).transpose(1, 2) + e.position_embedding.weight
        for blk in self.encoder.layers:
            x = blk(x)
        return self.post_layernorm(x)


class Projector(nn.Module):
    def __init__(self, v: dict, hidden: int, tokens: int):
        super().__init__()
        d = v["hidden_size"]
        self.side, self.out_side = v["image_size"] // v.get("patch_size", 14), int(tokens ** 0.5)
        self.mm_input_projection_weight = nn.Parameter(torch.empty(d, hidden), requires_grad=False)
        self.mm_soft_emb_norm = RMSNorm(d, v.get("layer_norm_eps", 1e-6), 1.0)

    def forward(self, x):  # [images, patches, d] -> [images, tokens, hidden]
        b, _, d = x.shape
        k = self.side // self.out_side
        g = F.avg_pool2d(x.transpose(1, 2).reshape(b, d, self.side, self.side), k, k).flatten(2).transpose(1, 2)
        w = self.mm_input_projection_weight
        return (self.mm_soft_emb_norm(g.reshape(-1, d).contiguous()) @ w).view(b, -1, w.shape[1])


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    def __init__(self, cfg: dict):
        super().__init__(cfg)
        mm = cfg["_mm"]
        self.vision_tower = SiglipVision(mm["vision_config"])
        self.multi_modal_projector = Projector(mm["vision_config"], cfg["hidden_size"],
                                               mm.get("mm_tokens_per_image", 256))
        self.processor = Gemma3Processor(cfg)

    def mm_positions(self, num_prompt: int, images) -> tuple[np.ndarray, int]:
        return np.broadcast_to(np.arange(num_prompt), (3, num_prompt)), 0  # plain positions

    def encode_images(self, images) -> list[tuple[torch.Tensor, None]]:
        w = self.multi_modal_projector.mm_input_projection_weight
        pixels = torch.from_numpy(np.stack([self.processor.pixel_values(im) for im in images])).to(w.device, w.dtype)
        return [(e, None) for e in self.multi_modal_projector(self.vision_tower(pixels))]

    def forward(self, input_ids, positions, mm=None):
        if mm is None or mm.rows is None:
            return super().forward(input_ids, positions)
        # the soft token's id may lie past the text vocabulary (transformers embeds it as id 0)
        x = self.embed(input_ids.masked_fill(input_ids >= self.model.embed_tokens.weight.shape[0], 0))
        x[mm.rows] = mm.embeds.to(x.dtype)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual)
        return self.model.norm.add_forward(x, residual)[0]

    def load_weights(self, weights) -> None:
        super().load_weights(renamed(weights, skip=("vision_tower.head.",)))  # SigLIP's pooling head: unused


register("Gemma3ForConditionalGeneration", Gemma3ForConditionalGeneration)

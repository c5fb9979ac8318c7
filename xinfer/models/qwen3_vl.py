"""Qwen3-VL (dense and MoE): a ViT over each image's patches (learned position table resampled to
the image's grid, 2D rotary, full attention within one image), a patch merger into the language
model's width, DeepStack features from a few encoder layers added to the image tokens' hidden
states after the first decoder layers, and M-RoPE on the language model (xinfer/mm/qwen_vl.py)."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ops.rotary import RotaryEmbedding
from xinfer.mm.qwen_vl import QwenVLProcessor, mrope_positions
from xinfer.models.layers import ACTIVATIONS, Embedding, Linear
from xinfer.models.llama import max_positions, rope_params
from xinfer.models.qwen3 import Qwen3ForCausalLM
from xinfer.models.qwen3_moe import Qwen3MoeForCausalLM
from xinfer.models.registry import register


class MRotaryEmbedding(RotaryEmbedding):
    """Rotary whose frequencies each follow one of three position rows (time, height, width).
    One-row positions (text only) take the plain table, and its fast paths."""

    def __init__(self, head_dim: int, max_position: int, theta: float, section: list[int], interleaved: bool):
        super().__init__(head_dim, max_position, theta)
        half = head_dim // 2
        if interleaved:  # frequency j follows height when j % 3 == 1, width when 2, within the sections
            axis = [1 if j % 3 == 1 and j < 3 * section[1] else 2 if j % 3 == 2 and j < 3 * section[2] else 0
                    for j in range(half)]
        else:
            axis = [0] * section[0] + [1] * section[1] + [2] * section[2]
        self.register_buffer("axis", torch.tensor(axis[:half], dtype=torch.long), persistent=False)

    def forward(self, positions, q, k):
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        idx = self.axis.view(1, 1, -1).expand(1, positions.shape[1], -1)
        cos = self.cos[positions].gather(0, idx)[0].unsqueeze(1)
        sin = self.sin[positions].gather(0, idx)[0].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x, cos, sin):
    """Rotate-half layout; cos and sin hold half the head."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


# ---- the vision encoder ----

class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = Linear(dim, [3 * dim], bias=True)
        self.proj = Linear(dim, [dim], bias=True)

    def forward(self, x, cos, sin, lens: list[int]):
        t = x.shape[0]
        q, k, v = self.qkv(x).view(t, 3, self.heads, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = [F.scaled_dot_product_attention(*(a.transpose(0, 1)[None] for a in parts))[0].transpose(0, 1)
               for parts in zip(q.split(lens), k.split(lens), v.split(lens))]  # each image sees only itself
        return self.proj(torch.cat(out).reshape(t, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, inter: int, act: str):
        super().__init__()
        self.linear_fc1 = Linear(dim, [inter], bias=True)
        self.linear_fc2 = Linear(inter, [dim], bias=True)
        self.act = ACTIVATIONS[act]

    def forward(self, x):
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, v: dict):
        super().__init__()
        d = v["hidden_size"]
        self.norm1 = nn.LayerNorm(d, eps=1e-6)
        self.norm2 = nn.LayerNorm(d, eps=1e-6)
        self.attn = VisionAttention(d, v["num_heads"])
        self.mlp = VisionMLP(d, v["intermediate_size"], v.get("hidden_act", "gelu_pytorch_tanh"))

    def forward(self, x, cos, sin, lens):
        x = x + self.attn(self.norm1(x), cos, sin, lens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge x merge neighbouring patches into one token of the language model's width;
    `postshuffle`: the norm over the merged vector (DeepStack's), else over each patch."""

    def __init__(self, v: dict, postshuffle: bool):
        super().__init__()
        d, self.wide = v["hidden_size"], v["hidden_size"] * v.get("spatial_merge_size", 2) ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.wide if postshuffle else d, eps=1e-6)
        self.linear_fc1 = Linear(self.wide, [self.wide], bias=True)
        self.linear_fc2 = Linear(self.wide, [v["out_hidden_size"]], bias=True)

    def forward(self, x):
        x = self.norm(x.reshape(-1, self.wide)) if self.postshuffle else self.norm(x).reshape(-1, self.wide)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class PatchEmbed(nn.Module):
    def __init__(self, v: dict):
        super().__init__()
        p, t = v.get("patch_size", 16), v.get("temporal_patch_size", 2)
        self.proj = nn.Conv3d(v.get("in_channels", 3), v["hidden_size"], (t, p, p), (t, p, p))

    def forward(self, x):  # a stride-equal-kernel convolution over one patch each: a matmul
        w = self.proj.weight
        return F.linear(x.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class VisionModel(nn.Module):
    def __init__(self, v: dict):
        super().__init__()
        self.merge = v.get("spatial_merge_size", 2)
        self.heads = v["num_heads"]
        self.patch_embed = PatchEmbed(v)
        self.pos_embed = Embedding(v["num_position_embeddings"], v["hidden_size"])
        self.side = int(v["num_position_embeddings"] ** 0.5)
        head = v["hidden_size"] // self.heads
        theta = float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        quarter = torch.arange(0, head // 2, 2, dtype=torch.float32) / (head // 2)
        self.register_buffer("inv_freq", 1.0 / theta ** quarter, persistent=False)
        self.blocks = nn.ModuleList(VisionBlock(v) for _ in range(v["depth"]))
        self.merger = PatchMerger(v, postshuffle=False)
        self.deepstack_indexes = list(v.get("deepstack_visual_indexes") or [])
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(v, postshuffle=True) for _ in self.deepstack_indexes)

    def _block_order(self, a: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """[h, w, ...] in the processor's patch order: merge x merge blocks, row by row."""
        m = self.merge
        return a.reshape(h // m, m, w // m, m, *a.shape[2:]).transpose(1, 2).reshape(h * w, *a.shape[2:])

    def _positions(self, h: int, w: int) -> torch.Tensor:
        """The learned square table resampled to h x w (bilinear, corners aligned)."""
        table = self.pos_embed.weight.view(self.side, self.side, -1)
        dev = table.device

        def taps(n):
            src = torch.arange(n, dtype=torch.float32, device=dev) * (self.side - 1) / max(n - 1, 1)
            lo = src.floor()
            return lo.long(), (lo.long() + 1).clamp(max=self.side - 1), src - lo
        hl, hh, hf = taps(h)
        wl, wh, wf = taps(w)
        hf, wf = hf[:, None, None], wf[None, :, None]
        out = (table[hl][:, wl] * ((1 - hf) * (1 - wf)) + table[hl][:, wh] * ((1 - hf) * wf)
               + table[hh][:, wl] * (hf * (1 - wf)) + table[hh][:, wh] * (hf * wf))
        return self._block_order(out, h, w)

    def _rotary(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.inv_freq.device
        rows, cols = torch.meshgrid(torch.arange(h, device=dev), torch.arange(w, device=dev), indexing="ij")
        rc = self._block_order(torch.stack([rows, cols], -1), h, w).float()
        f = torch.cat([rc[:, :1] * self.inv_freq, rc[:, 1:] * self.inv_freq], -1)  # half a head
        return f.cos()[:, None], f.sin()[:, None]

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]):
        """(merged tokens [patches / merge^2, out], DeepStack features, one such tensor per index)."""
        x = self.patch_embed(pixels)
        pos, cos, sin, lens = [], [], [], []
        for t, h, w in grids:
            c, s = self._rotary(h, w)
            pos += [self._positions(h, w)] * t
            cos += [c] * t
            sin += [s] * t
            lens += [h * w] * t
        x = x + torch.cat(pos).to(x.dtype)
        cos, sin = torch.cat(cos), torch.cat(sin)
        deep = []
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, lens)
            if i in self.deepstack_indexes:
                deep.append(self.deepstack_merger_list[self.deepstack_indexes.index(i)](x))
        return self.merger(x), deep


# ---- the language model ----

class Qwen3VLMixin:
    """What Qwen3-VL adds to its text family: the encoder, M-RoPE and image embeddings spliced in."""

    def __init__(self, cfg: dict):
        super().__init__(cfg)
        vision = cfg["_mm"]["vision_config"]
        self.visual = VisionModel(vision)
        self.processor = QwenVLProcessor(cfg)
        self.merge = vision.get("spatial_merge_size", 2)

    def make_rotary(self, cfg, idx, layer_type=None):
        rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if "mrope_section" not in rp:
            return super().make_rotary(cfg, idx, layer_type)
        if "mrope" not in self._rotary:
            theta, _ = rope_params(cfg)
            self._rotary["mrope"] = MRotaryEmbedding(self.head_dim, max_positions(cfg), theta, rp["mrope_section"],
                                                     rp.get("mrope_interleaved", False))
        return self._rotary["mrope"]

    def mm_positions(self, num_prompt: int, images) -> tuple[np.ndarray, int]:
        return mrope_positions(num_prompt, images, self.merge)

    def encode_images(self, images) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Every image's (embeddings [tokens, hidden], DeepStack features [layers, tokens, hidden]),
        the batch through the encoder at once."""
        w = self.visual.patch_embed.proj.weight
        pixels = torch.from_numpy(np.concatenate([self.processor.pixel_values(im) for im in images])).to(w.device)
        merged, deep = self.visual(pixels, [tuple(im.grid) for im in images])
        lens = [im.length for im in images]
        parts = merged.split(lens)
        deep = [d.split(lens) for d in deep]
        return [(parts[i], torch.stack([d[i] for d in deep]) if deep else None) for i in range(len(images))]

    def forward(self, input_ids, positions, mm=None):
        if mm is None:
            return super().forward(input_ids, positions)
        if mm.rows is None:  # shifted text positions only: the text model's own path
            return super().forward(input_ids, mm.positions)
        x = self.embed(input_ids)
        x[mm.rows] = mm.embeds.to(x.dtype)
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(mm.positions, x, residual)
            if mm.deepstack is not None and i < mm.deepstack.shape[0]:
                x = x.to(residual.dtype)  # a layer's output may be bfloat16 (DecoderLayer.bf16_io)
                x[mm.rows] += mm.deepstack[i].to(x.dtype)
        return self.model.norm.add_forward(x, residual)[0]

    def load_weights(self, weights) -> None:
        def renamed():
            for name, t in weights:
                if name.startswith("model.language_model."):
                    name = "model." + name[len("model.language_model."):]
                elif name.startswith("model.visual."):
                    name = name[len("model."):]
                yield name, t
        super().load_weights(renamed())


class Qwen3VLForConditionalGeneration(Qwen3VLMixin, Qwen3ForCausalLM):
    pass


class Qwen3VLMoeForConditionalGeneration(Qwen3VLMixin, Qwen3MoeForCausalLM):
    pass


register("Qwen3VLForConditionalGeneration", Qwen3VLForConditionalGeneration)
register("Qwen3VLMoeForConditionalGeneration", Qwen3VLMoeForConditionalGeneration)

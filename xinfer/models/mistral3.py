"""Mistral 3 with images: the Pixtral encoder (a bias-free patch convolution, RMSNorm, pre-norm
SwiGLU blocks with full attention within one image and 2D rotary over the patch grid: half the
rotated frequencies follow the row, half the column), the projector (RMSNorm, a learned merge of
each spatial_merge_size^2 block of patches, two linears), spliced into the [IMG] tokens of
xinfer/models/mistral.py's text model; [IMG_BREAK] / [IMG_END] keep their own embeddings."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ops.norm import RMSNorm
from xinfer.errors import ModelLoadError
from xinfer.mm.pixtral import PixtralProcessor
from xinfer.models.gemma3_vision import renamed
from xinfer.models.layers import ACTIVATIONS, GatedMLP, Linear
from xinfer.models.mistral import MistralForCausalLM
from xinfer.models.registry import register

RENAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
           ("language_model.lm_head.", "lm_head."), ("model.vision_tower.", "vision_tower."),
           ("model.multi_modal_projector.", "multi_modal_projector."))


def _rotate(x, cos, sin):
    """Rotate-half layout; cos and sin hold half the head."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class PixtralBlock(nn.Module):
    def __init__(self, v: dict):
        super().__init__()
        d = v["hidden_size"]
        self.heads = v["num_attention_heads"]
        self.attention_norm = RMSNorm(d, 1e-5)
        self.ffn_norm = RMSNorm(d, 1e-5)
        self.attention = nn.Module()
        self.attention.qkv_proj = Linear(d, [d, d, d], shards=["q", "k", "v"])
        self.attention.o_proj = Linear(d, [d])
        self.feed_forward = GatedMLP(d, v["intermediate_size"], v.get("hidden_act", "gelu"))

    def forward(self, x, cos, sin, lens: list[int]):
        t = x.shape[0]
        q, k, v = self.attention.qkv_proj(self.attention_norm(x)).view(t, 3, self.heads, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        o = [F.scaled_dot_product_attention(*(a.transpose(0, 1)[None] for a in parts))[0].transpose(0, 1)
             for parts in zip(q.split(lens), k.split(lens), v.split(lens))]  # each image sees only itself
        x = x + self.attention.o_proj(torch.cat(o).reshape(t, -1))
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralVision(nn.Module):
    def __init__(self, v: dict, layers: int):
        super().__init__()
        d, self.patch = v["hidden_size"], v.get("patch_size", 16)
        self.patch_conv = nn.Conv2d(v.get("num_channels", 3), d, self.patch, stride=self.patch, bias=False)
        self.ln_pre = RMSNorm(d, 1e-5)
        self.transformer = nn.Module()
        self.transformer.layers = nn.ModuleList(PixtralBlock(v) for _ in range(layers))
        head = v.get("head_dim") or d // v["num_attention_heads"]
        theta = float((v.get("rope_parameters") or {}).get("rope_theta", v.get("rope_theta", 10000.0)))
        freq = 1.0 / theta ** (torch.arange(0, head, 2, dtype=torch.float32) / head)
        self.register_buffer("freq_rows", freq[0::2].clone(), persistent=False)
        self.register_buffer("freq_cols", freq[1::2].clone(), persistent=False)

    def _rotary(self, h: int, w: int):
        dev = self.freq_rows.device
        rows, cols = torch.meshgrid(torch.arange(h, device=dev), torch.arange(w, device=dev), indexing="ij")
        f = torch.cat([rows.reshape(-1, 1) * self.freq_rows, cols.reshape(-1, 1) * self.freq_cols], -1)
        return f.cos()[:, None], f.sin()[:, None]

    def forward(self, pixels: list[torch.Tensor]) -> torch.Tensor:
        """Each image [3, H, W] -> all images' patches [sum of patches, d], row-major per image."""
        x, cos, sin, lens = [], [], [], []
        for px in pixels:
            x.append(self.patch_conv(px[None].to(self.patch_conv.weight.dtype))[0].flatten(1).T)
            c, s = self._rotary(px.shape[1] // self.patch, px.shape[2] // self.patch)
            cos.append(c), sin.append(s), lens.append(x[-1].shape[0])
        x, cos, sin = self.ln_pre(torch.cat(x).contiguous()), torch.cat(cos), torch.cat(sin)
        for blk in self.transformer.layers:
            x = blk(x, cos, sin, lens)
        return x


class Projector(nn.Module):
    def __init__(self, mm: dict, hidden: int, eps: float):
        super().__init__()
        d, self.merge = mm["vision_config"]["hidden_size"], mm.get("spatial_merge_size", 2)
        bias = mm.get("multimodal_projector_bias", False)
        self.norm = RMSNorm(d, eps)
        self.patch_merger = nn.Module()
        self.patch_merger.merging_layer = Linear(d * self.merge ** 2, [d])
        self.linear_1 = Linear(d, [hidden], bias=bias)
        self.linear_2 = Linear(hidden, [hidden], bias=bias)
        self.act = ACTIVATIONS[mm.get("projector_hidden_act", "gelu")]

    def forward(self, x, h: int, w: int):
        """One image's patches [h * w, d] (its h x w grid) -> [h / merge * w / merge, hidden]."""
        m, d = self.merge, x.shape[-1]
        x = self.norm(x).view(h // m, m, w // m, m, d).permute(0, 2, 4, 1, 3).reshape(-1, d * m * m)
        return self.linear_2(self.act(self.linear_1(self.patch_merger.merging_layer(x))))


class Mistral3ForConditionalGeneration(MistralForCausalLM):
    def __init__(self, cfg: dict):
        if cfg.get("model_type", "mistral") not in ("mistral", "llama"):
            raise ModelLoadError(f"Mistral 3 with a {cfg['model_type']!r} text model is not served yet "
                                 "(its text model is a Mistral or Llama one here)")
        super().__init__(cfg)
        mm = cfg["_mm"]
        v = mm["vision_config"]
        feature = mm.get("vision_feature_layer", -1)
        if not isinstance(feature, int):
            raise ModelLoadError("Mistral 3 with several vision feature layers is not served yet")
        # hidden state k of the encoder: after its first k blocks (0: the patch embeddings)
        self.vision_tower = PixtralVision(v, feature % (v["num_hidden_layers"] + 1))
        self.multi_modal_projector = Projector(mm, cfg["hidden_size"], cfg["rms_norm_eps"])
        self.processor = PixtralProcessor(cfg)
        self.image_id = self.processor.placeholder_id
        self.merge = self.multi_modal_projector.merge

    def mm_positions(self, num_prompt: int, images) -> tuple[np.ndarray, int]:
        return np.broadcast_to(np.arange(num_prompt), (3, num_prompt)), 0  # plain positions

    def encode_images(self, images) -> list[tuple[torch.Tensor, None]]:
        """Per image [rows * (cols + 1), hidden]: its merged tokens row by row, a zero row where the
        [IMG_BREAK] / [IMG_END] token is (forward keeps those tokens' embeddings)."""
        dev = self.vision_tower.patch_conv.weight.device
        feats = self.vision_tower([torch.from_numpy(self.processor.pixel_values(im)).to(dev) for im in images])
        out = []
        for im, f in zip(images, feats.split([im.grid[1] * im.grid[2] for im in images])):
            _, gh, gw = im.grid
            rows, cols = gh // self.merge, gw // self.merge
            e = self.multi_modal_projector(f, gh, gw)
            framed = e.new_zeros(rows, cols + 1, e.shape[-1])
            framed[:, :cols] = e.view(rows, cols, -1)
            out.append((framed.view(-1, e.shape[-1]), None))
        return out

    def forward(self, input_ids, positions, mm=None):
        if mm is None or mm.rows is None:
            return super().forward(input_ids, positions)
        x = self.embed(input_ids)
        take = input_ids[mm.rows] == self.image_id
        x[mm.rows[take]] = mm.embeds[take].to(x.dtype)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual)
        return self.model.norm.add_forward(x, residual)[0]

    def load_weights(self, weights) -> None:
        depth = len(self.vision_tower.transformer.layers)
        unused = tuple(f"vision_tower.transformer.layers.{i}." for i in range(depth, 256))  # past the feature layer
        super().load_weights(renamed(weights, RENAMES, skip=unused))


register("Mistral3ForConditionalGeneration", Mistral3ForConditionalGeneration)

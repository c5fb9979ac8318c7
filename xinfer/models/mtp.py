"""Multi-token-prediction heads (DeepSeek-V3 `num_nextn_predict_layers`, GLM-4.5's next-n layers):
the drafts of --speculative-method mtp (xinfer/workers/mtp.py runs them).

The first depth at position p reads the target's final hidden state h_p (after its norm, as vLLM and
Megatron feed it) and the embedding of the token at p + 1:
    x = eh_proj([enorm(embed(t_{p+1})); hnorm(h_p)]),  g = decoder_layer(x),
and predicts t_{p+2} from lm_head(shared_head.norm(g)). Its own attention keeps a KV cache in the
target's blocks. A draft further ahead feeds g back as the hidden state (the one depth reused, as
vLLM does when it has fewer depths than drafts).

Checkpoints store depth i as decoder layer `num_hidden_layers + i`, with its own copies of the
embedding and output head: those equal the target's in the released models and are not loaded.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from ops.norm import RMSNorm
from xinfer.models.layers import Linear, _target

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")
_OWN = {"enorm", "hnorm", "eh_proj", "shared_head"}  # the head's own weights; the rest are its decoder layer's
_SHARED_COPIES = ("embed_tokens.", "shared_head.head.")


class MTPHead(nn.Module):
    """The first MTP depth: called as `head(ids, positions, hidden)` in a paged forward
    (xinfer/workers/batch.forward) it returns its output g; `compute_logits(g)`, the next token's logits. Checkpoints with more depths
    (none released yet) draft with the first alone: the others are not loaded."""

    def __init__(self, target, cfg: dict):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.enorm, self.hnorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.eh_proj = Linear(2 * h, [h])
        self.block = target.layer_cls(target, cfg, cfg["num_hidden_layers"])
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, eps)
        self._target = [target]  # not a submodule: its parameters are the target's own

    def forward(self, input_ids, positions, hidden):
        emb = self._target[0].embed(input_ids)
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))
        x, residual = self.block(positions, x, None)
        return x + residual

    def compute_logits(self, g):
        return self._target[0].compute_logits(self.shared_head.norm(g))

    def attention_layers(self):
        return [self.block.self_attn]


def mtp_layers(cfg: dict) -> int:
    return cfg.get("num_nextn_predict_layers") or cfg.get("mtp_num_hidden_layers") or 0


def attach(model, cfg: dict) -> None:
    """Give the model its MTP head when the engine drafts with it (`_mtp` set by the model runner)."""
    model.mtp = MTPHead(model, cfg) if cfg.get("_mtp") and mtp_layers(cfg) else None


def without_mtp(weights, num_layers: int, keep: bool):
    """The checkpoint's weights less the MTP depths' (`model.layers.{num_layers + i}`), or, when
    `keep`, less all but the first depth's, and its copies of the embedding and head."""
    for name, t in weights:
        m = _LAYER.match(name)
        if m is None or int(m[1]) < num_layers or (keep and int(m[1]) == num_layers and not m[2].startswith(_SHARED_COPIES)):
            yield name, t


def mtp_target(model, name: str):
    """A model's `remap` first: an MTP depth's checkpoint name -> its parameter in the MTP head
    (then through the model's own remap, as the decoder's are), else None."""
    m = _LAYER.match(name)
    n = model.cfg["num_hidden_layers"]
    if getattr(model, "mtp", None) is None or m is None or int(m[1]) != n:
        return None
    own = m[2].split(".")[0] in _OWN
    return _target(f"mtp.{'' if own else 'block.'}{m[2]}", model.remap)

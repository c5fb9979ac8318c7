"""BERT-style encoders (BertModel, BertForMaskedLM: sentence-transformers' all-MiniLM, bge, e5...): the
embedding model of --embedding-model (xinfer/embedding_model.py). Post-LN layers, bidirectional
attention over a padded batch (a key-padding mask, no causal mask, no KV cache: one forward per
batch), erf GELU. Module names follow HF's, so a checkpoint loads by name."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xinfer.errors import ModelLoadError
from xinfer.models.registry import register_encoder

_ACTS = {"gelu": F.gelu, "relu": F.relu,
         "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class Embeddings(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], h)
        self.position_embeddings = nn.Embedding(cfg["max_position_embeddings"], h)
        self.token_type_embeddings = nn.Embedding(cfg.get("type_vocab_size", 2), h)
        self.LayerNorm = nn.LayerNorm(h, eps=cfg.get("layer_norm_eps", 1e-12))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        # one segment: token type 0 everywhere (what a sentence encoder is given)
        x = self.word_embeddings(ids) + self.position_embeddings(pos)[None] + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class SelfAttention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        self.heads = cfg["num_attention_heads"]
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = (m(x).view(b, t, self.heads, h // self.heads).transpose(1, 2)
                   for m in (self.query, self.key, self.value))
        # mask [b, 1, 1, t]: every query sees every real key; a padding row's output is never pooled
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return o.transpose(1, 2).reshape(b, t, h)


class DenseNorm(nn.Module):
    """HF's BertSelfOutput / BertOutput: dense, then LayerNorm over it plus the residual (post-LN)."""
    def __init__(self, cfg: dict, d_in: int):
        super().__init__()
        self.dense = nn.Linear(d_in, cfg["hidden_size"])
        self.LayerNorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg.get("layer_norm_eps", 1e-12))

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.add_module("self", SelfAttention(cfg))  # HF's name; `self.self` would read badly
        self.output = DenseNorm(cfg, cfg["hidden_size"])

    def forward(self, x, mask):
        return self.output(self._modules["self"](x, mask), x)


class Intermediate(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.dense = nn.Linear(cfg["hidden_size"], cfg["intermediate_size"])
        self.act = _ACTS[cfg.get("hidden_act", "gelu")]

    def forward(self, x):
        return self.act(self.dense(x))


class Layer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.attention = Attention(cfg)
        self.intermediate = Intermediate(cfg)
        self.output = DenseNorm(cfg, cfg["intermediate_size"])

    def forward(self, x, mask):
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.layer = nn.ModuleList(Layer(cfg) for _ in range(cfg["num_hidden_layers"]))


class BertModel(nn.Module):
    """forward(ids [b, t], mask [b, t] bool) -> the last hidden states [b, t, hidden] (no pooler)."""

    def __init__(self, cfg: dict):
        super().__init__()
        act, pos = cfg.get("hidden_act", "gelu"), cfg.get("position_embedding_type", "absolute")
        if act not in _ACTS:
            raise ModelLoadError(f"BERT hidden_act {act!r} is not supported ({', '.join(_ACTS)})")
        if pos != "absolute":
            raise ModelLoadError(f"BERT position_embedding_type {pos!r} is not supported (absolute only)")
        if cfg.get("is_decoder"):
            raise ModelLoadError("a BERT decoder (is_decoder) is no sentence encoder")
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(ids)
        m = mask[:, None, None, :]
        for layer in self.encoder.layer:
            x = layer(x, m)
        return x

    def load_hf(self, state: dict[str, torch.Tensor]) -> None:
        """An HF checkpoint's tensors: `bert.` prefixes (BertForMaskedLM) stripped, old gamma/beta
        LayerNorm names renamed; heads, the pooler and position_ids buffers are not used."""
        mine = self.state_dict()
        got = {}
        for k, v in state.items():
            k = k.removeprefix("bert.")
            if k.endswith("LayerNorm.gamma") or k.endswith("LayerNorm.beta"):
                k = k[:-5] + "weight" if k.endswith("gamma") else k[:-4] + "bias"
            if k in mine:
                got[k] = v
        missing = sorted(set(mine) - set(got))
        if missing:
            raise ModelLoadError(f"the checkpoint lacks {len(missing)} BERT weights, e.g. {missing[:3]}")
        for k, v in got.items():
            if tuple(v.shape) != tuple(mine[k].shape):
                raise ModelLoadError(f"{k}: shape {tuple(v.shape)} in the checkpoint, {tuple(mine[k].shape)} "
                                     "from config.json")
        self.load_state_dict(got)


register_encoder("BertModel", BertModel)
register_encoder("BertForMaskedLM", BertModel)

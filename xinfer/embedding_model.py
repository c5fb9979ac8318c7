"""A separate embedding model (`xinfer serve --embedding-model PATH`, or offline `xinfer.EmbeddingModel`):
an HF folder of a BERT-style encoder (config.json, model.safetensors,
tokenizer.json), one forward per batch, pooled (mean over the real tokens, or the [CLS] token)
and L2-normalised, as sentence-transformers does. Float32 on the CPU unless told otherwise: these
models are small, and the server runs this one in the API process (xinfer/api/embed_batcher.py)."""
from __future__ import annotations

import json
import os

import numpy as np
import torch

from xinfer.errors import InvalidRequestError, ModelLoadError
from xinfer.models import ENCODERS, model_class

POOLINGS = ("mean", "cls")
MAX_BATCH_TOKENS = 16384  # padded tokens per forward: bounds the attention's memory, not the request


class EmbeddingModel:
    def __init__(self, path: str, pooling: str = "mean", device: str = "cpu", dtype: torch.dtype = torch.float32):
        if pooling not in POOLINGS:
            raise ValueError(f"--embedding-pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        path = os.path.abspath(os.path.expanduser(path))
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise ModelLoadError(f"--embedding-model {path}: no config.json there (an HF model folder is needed)")
        with open(cfg_file) as f:
            self.config = json.load(f)
        self.path, self.pooling, self.device = path, pooling, torch.device(device)
        self.name = os.path.basename(path.rstrip("/"))
        self.hidden_size = int(self.config["hidden_size"])
        self.vocab_size = int(self.config["vocab_size"])
        self.max_len = int(self.config.get("max_position_embeddings", 512))
        self.tokenizer = _tokenizer(path)
        if not self.config.get("architectures") and self.config.get("model_type") == "bert":
            self.config["architectures"] = ["BertModel"]  # older exports name only the type
        model = model_class(self.config, ENCODERS)(self.config)
        model.load_hf(_weights(path))
        self.model = model.to(device=self.device, dtype=dtype).eval()

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids with the model's [CLS] / [SEP], untruncated (check() refuses what is too long)."""
        if self.tokenizer is None:
            raise InvalidRequestError("this embedding model has no tokenizer.json: send token ids", param="input")
        return [e.ids for e in self.tokenizer.encode_batch(list(texts))]

    def check(self, ids: list[int], what: str = "input") -> None:
        if not ids:
            raise InvalidRequestError(f"{what} is empty", param="input")
        if len(ids) > self.max_len:
            raise InvalidRequestError(f"{what} has {len(ids)} tokens; the embedding model {self.name} takes up to "
                                      f"{self.max_len}", param="input", code="context_length_exceeded")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"{what}: unknown token id {bad} (vocabulary size {self.vocab_size})",
                                      param="input")

    def embed(self, inputs, normalize: bool = True) -> np.ndarray:
        """[n, hidden] float32 for strings or token id lists; normalised to unit length unless told not to."""
        inputs = list(inputs)
        if inputs and all(isinstance(x, str) for x in inputs):
            inputs = self.encode(inputs)
        for i, ids in enumerate(inputs):
            self.check(ids, f"input[{i}]")
        return self.embed_ids(inputs, normalize)

    @torch.inference_mode()
    def embed_ids(self, prompts: list[list[int]], normalize: bool = True) -> np.ndarray:
        """Checked token id lists -> vectors; sorted by length into batches of similar lengths so that
        little is padding."""
        out = np.zeros((len(prompts), self.hidden_size), dtype=np.float32)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order) and (end + 1 - start) * len(prompts[order[end]]) <= MAX_BATCH_TOKENS:
                end += 1
            batch = [prompts[i] for i in order[start:end]]
            out[order[start:end]] = self._forward(batch, normalize)
            start = end
        return out

    def _forward(self, batch: list[list[int]], normalize: bool) -> np.ndarray:
        t = max(len(ids) for ids in batch)
        ids = torch.zeros((len(batch), t), dtype=torch.long)
        mask = torch.zeros((len(batch), t), dtype=torch.bool)
        for i, p in enumerate(batch):
            ids[i, :len(p)] = torch.tensor(p)
            mask[i, :len(p)] = True
        ids, mask = ids.to(self.device), mask.to(self.device)
        h = self.model(ids, mask).float()
        if self.pooling == "cls":
            v = h[:, 0]
        else:
            m = mask[..., None].float()
            v = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
        if normalize:
            v = torch.nn.functional.normalize(v, dim=-1)
        return v.cpu().numpy()


def _tokenizer(path: str):
    """tokenizer.json's WordPiece without its stored truncation and padding (sentence-transformers'
    exports fix both at 128): an input is refused when too long, never cut silently."""
    f = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(f):
        return None
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(f)
    tok.no_truncation()
    tok.no_padding()
    return tok


def _weights(path: str) -> dict[str, torch.Tensor]:
    """Safetensors only, as for the served model: a pickle `.bin` is refused."""
    st = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not st:
        raise ModelLoadError(f"--embedding-model {path}: no *.safetensors there (pickle .bin files are refused)")
    from safetensors.torch import load_file
    state = {}
    for f in st:
        state.update(load_file(os.path.join(path, f)))
    return state

"""The worker's side of images: each sequence's M-RoPE positions, the encoder run for the images a
step reaches (all of the step's at once), an embedding cache by content hash, and the step's
inputs: which rows take image embeddings, and the positions of every row."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

# Embeddings kept for images sent again (the next turn of a chat, the same picture in many
# requests); a step's own images are pinned in their sequences whatever this says.
CACHE_BYTES = 256 << 20


@dataclass
class SeqImages:
    images: list  # ImageData, in prompt order
    positions: np.ndarray  # [3, prompt tokens]
    delta: int  # what every position past the prompt is shifted by
    pinned: dict = field(default_factory=dict)  # image index -> (embeddings, deepstack) until its last row runs


class MMBatch(NamedTuple):
    positions: torch.Tensor  # [3, T], or [T] when no row of the step is an image token
    rows: torch.Tensor | None  # the image-token rows of the step
    embeds: torch.Tensor | None  # [len(rows), hidden]
    deepstack: torch.Tensor | None  # [layers, len(rows), hidden]
    spans: list | None = None  # AttnMetadata.bidirectional: each row sequence's whole images in the step


class VisionInputs:
    def __init__(self, model, device):
        self.model, self.device = model, device
        self.cache: OrderedDict[bytes, tuple] = OrderedDict()
        self.used = 0

    def new_seq(self, num_prompt: int, images) -> SeqImages:
        pos, delta = self.model.mm_positions(num_prompt, images)
        return SeqImages(list(images), pos, delta)

    def inputs(self, seqs, rows) -> MMBatch | None:
        """`seqs`: the WorkerSeq of each row of `rows` (block ids, start, tokens)."""
        if all(ws.mm is None for ws in seqs):
            return None
        spans = [(ws.mm, start, len(toks)) for ws, (_, start, toks) in zip(seqs, rows)]
        self._encode(spans)
        pos, idx, emb, deep, at, whole = [], [], [], [], 0, []
        for m, start, n in spans:
            whole.append([])
            p = np.arange(start, start + n)
            if m is None:
                pos.append(np.broadcast_to(p, (3, n)))
                at += n
                continue
            q = np.empty((3, n), dtype=np.int64)
            inside = p < m.positions.shape[1]
            q[:, inside] = m.positions[:, p[inside]]
            q[:, ~inside] = p[~inside] + m.delta
            pos.append(q)
            for i, im in enumerate(m.images):
                lo, hi = max(start, im.offset), min(start + n, im.offset + im.length)
                if lo >= hi:
                    continue
                e, d = m.pinned[i]
                idx.append(np.arange(at + lo - start, at + hi - start))
                emb.append(e[lo - im.offset:hi - im.offset])
                if d is not None:
                    deep.append(d[:, lo - im.offset:hi - im.offset])
                if im.whole:
                    whole[-1].append((im.offset, im.offset + im.length))
                if hi == im.offset + im.length:  # its last rows: the KV cache holds the rest
                    del m.pinned[i]
            at += n
        positions = np.concatenate(pos, axis=1)
        if not idx:  # text rows only: their three rows are equal
            return MMBatch(torch.from_numpy(positions[0].copy()).to(self.device), None, None, None)
        return MMBatch(torch.from_numpy(positions).to(self.device),
                       torch.from_numpy(np.concatenate(idx)).to(self.device), torch.cat(emb),
                       torch.cat(deep, dim=1) if deep else None, whole if any(whole) else None)

    def _encode(self, spans) -> None:
        """Pin the embeddings of every image the step reaches: from the cache, or all the missing
        ones through the encoder in one batch."""
        todo: dict[bytes, tuple] = {}
        for m, start, n in spans:
            if m is None:
                continue
            for i, im in enumerate(m.images):
                if i in m.pinned or not (im.offset < start + n and start < im.offset + im.length):
                    continue
                hit = self.cache.get(im.hash)
                if hit is not None:
                    self.cache.move_to_end(im.hash)
                    m.pinned[i] = hit
                else:
                    todo.setdefault(im.hash, (im, []))[1].append((m, i))
        if not todo:
            return
        outs = self.model.encode_images([im for im, _ in todo.values()])
        for (h, (_, users)), out in zip(todo.items(), outs):
            for m, i in users:
                m.pinned[i] = out
            self._keep(h, out)

    def _keep(self, h: bytes, out) -> None:
        size = sum(t.numel() * t.element_size() for t in out if t is not None)
        if size > CACHE_BYTES:
            return
        self.cache[h] = out
        self.used += size
        while self.used > CACHE_BYTES:
            _, old = self.cache.popitem(last=False)
            self.used -= sum(t.numel() * t.element_size() for t in old if t is not None)

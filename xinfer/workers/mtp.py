"""--speculative-method mtp: the target's own multi-token-prediction head (xinfer/models/mtp.py)
proposes the drafts.

The head at position p reads the target's hidden state there and the token after it, so its KV
cache can only follow the target: after every step, each sequence's positions the target computed
and kept run through the head (one decoder layer's work per token), and the head's output at the
last one is kept in WorkerSeq.mtp_hidden. A step that speculates starts its drafts from it; each
further draft feeds the head's own output back at the next position. Those positions' KV are
rewritten by the catch-up once the target has verified them.

The head's KV for a prefix-cache hit is the one the block's first owner wrote: its last position
depends on the token after the block, which another sequence may not share. Only the drafts can
suffer (the target verifies every one): the output does not change.
"""
from __future__ import annotations

import torch

from xinfer.workers.batch import forward
from xinfer.workers.drafter import Drafter


class MtpDrafter(Drafter):
    follows_target = True

    def __init__(self, target, backend, device, block_size: int, vocab_size: int, eos_ids: list[int]):
        super().__init__(target.mtp, backend, device, block_size, vocab_size, eos_ids, chunk=0)
        self._g: dict[int, torch.Tensor] = {}  # a proposal's last head output per sequence

    def after_step(self, rows) -> None:
        """`rows`: (WorkerSeq, first position, target hidden states [m, H]) of the m positions from
        there the target computed and kept this step; the token after each is in ws.tokens."""
        rows = [r for r in rows if len(r[2])]
        if not rows:
            return
        g = forward(self.model, self.backend, self.device, self.block_size,
                    [(ws.block_ids, p, ws.tokens[p + 1:p + 1 + len(h)]) for ws, p, h in rows],
                    hidden=torch.cat([h for _, _, h in rows]))
        end = 0
        for ws, _, h in rows:
            end += len(h)
            ws.mtp_hidden = g[end - 1:end].clone()

    def _first(self, sids, seqs) -> torch.Tensor:
        # No output yet (a restarted worker whose whole prompt was cached): drafts from nothing,
        # which the target rejects, until the first catch-up.
        w = self.model.enorm.weight
        zero = torch.zeros(1, w.shape[0], device=w.device, dtype=w.dtype)
        self._g = {sid: seqs[sid].mtp_hidden if seqs[sid].mtp_hidden is not None else zero for sid in sids}
        return self._logits(torch.cat([self._g[sid] for sid in sids]))

    def _next(self, sids, seqs, drafts) -> torch.Tensor:
        # draft j + 1 comes from the head at position len(tokens) - 2 + j, reading draft j
        g = forward(self.model, self.backend, self.device, self.block_size,
                    [(seqs[sid].block_ids, len(seqs[sid].tokens) - 2 + len(drafts[sid]), [drafts[sid][-1]])
                     for sid in sids], hidden=torch.cat([self._g[sid] for sid in sids]))
        for i, sid in enumerate(sids):
            self._g[sid] = g[i:i + 1]
        return self._logits(g)

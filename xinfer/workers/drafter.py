"""--speculative-method draft: a second, smaller model with the target's tokenizer proposes the drafts.

It runs in the target's worker over the same block tables: its own K/V tensors, indexed by the
same block ids, so the scheduler's blocks hold both models' KV and nothing else is allocated. Its
cache catches up lazily, when a sequence speculates: WorkerSeq.draft_computed counts the tokens it
holds (a new or recomputed sequence starts at 0: what a shared prefix block holds for the draft is
never trusted, since the target's own verification would be the only check of it).
"""
from __future__ import annotations

import dataclasses

import torch

from ops.sampling import distribution, processed, race, uniforms
from xinfer.ipc.step import StepPlan
from xinfer.workers.batch import WorkerSeq, forward, sampling_batch

_SALT = 0x9E3779B97F4A7C15  # a seeded request's draft draws from a stream apart from its target's


class Drafter:
    # whether each step's target hidden states go to after_step (the MTP head's); a draft model
    # catches up lazily instead, when a sequence speculates
    follows_target = False

    def __init__(self, model, backend, device, block_size: int, vocab_size: int, eos_ids: list[int], chunk: int):
        self.model, self.backend, self.device = model, backend, device
        self.block_size, self.vocab_size, self.eos_ids, self.chunk = block_size, vocab_size, eos_ids, chunk

    def propose(self, plan: StepPlan, seqs: dict[int, WorkerSeq]) -> dict[int, tuple[list[int], torch.Tensor | None]]:
        """Drafts for the plan's sequences that speculate without given drafts: (tokens, the
        distributions they were drawn from [k, V], or None when every draft was an argmax)."""
        want = {s.seq_id: s.num_spec for s in plan.scheduled if s.num_spec and not s.draft_ids}
        sids = list(want)
        logits = self._first(sids, seqs)
        drafts = {sid: [] for sid in sids}
        qs = {sid: [] for sid in sids}
        greedy = all(seqs[sid].params.greedy for sid in sids)
        for j in range(max(want.values())):
            views = [dataclasses.replace(seqs[sid], tokens=seqs[sid].tokens + drafts[sid]) for sid in sids]
            b = sampling_batch(views, self.vocab_size, self.eos_ids, self.device)
            lg = processed(logits, b)
            if greedy:
                toks = lg.argmax(dim=-1).tolist()
            else:
                q = distribution(lg, b)
                seeds = [(r, s ^ _SALT) for r, s in b.seeds]
                toks = race(q, uniforms(*q.shape, seeds, q.device)).tolist()
                for i, sid in enumerate(sids):
                    qs[sid].append(q[i])
            for sid, t in zip(sids, toks):
                drafts[sid].append(t)
            sids = [sid for sid in sids if len(drafts[sid]) < want[sid]]
            if not sids:
                break
            logits = self._next(sids, seqs, drafts)
        return {sid: (d, torch.stack(qs[sid]) if qs[sid] else None) for sid, d in drafts.items()}

    def _first(self, sids, seqs) -> torch.Tensor:
        """The logits of each sequence's first draft."""
        return self._catch_up([seqs[sid] for sid in sids])

    def _next(self, sids, seqs, drafts) -> torch.Tensor:
        """The logits of the draft after each sequence's last one (its KV written now)."""
        logits = self._run([(seqs[sid], len(seqs[sid].tokens) + len(drafts[sid]) - 1, [drafts[sid][-1]])
                            for sid in sids])
        for sid in sids:
            seqs[sid].draft_computed += 1
        return logits

    def _catch_up(self, wss: list[WorkerSeq]) -> torch.Tensor:
        """Feed each sequence's tokens the draft has not seen (in chunks); its last row's logits."""
        last = [None] * len(wss)
        while True:
            todo = [i for i, ws in enumerate(wss) if ws.draft_computed < len(ws.tokens)]
            if not todo:
                return torch.cat(last)
            rows = []
            for i in todo:
                ws = wss[i]
                end = min(len(ws.tokens), ws.draft_computed + self.chunk)
                rows.append((ws, ws.draft_computed, ws.tokens[ws.draft_computed:end]))
            hidden = forward(self.model, self.backend, self.device, self.block_size,
                             [(ws.block_ids, start, toks) for ws, start, toks in rows])
            ends = torch.tensor([len(t) for _, _, t in rows]).cumsum(0) - 1
            out = self._logits(hidden[ends.to(hidden.device)])
            for n, (i, (ws, start, toks)) in enumerate(zip(todo, rows)):
                ws.draft_computed = start + len(toks)
                if ws.draft_computed == len(ws.tokens):
                    last[i] = out[n:n + 1]

    def _run(self, rows) -> torch.Tensor:
        hidden = forward(self.model, self.backend, self.device, self.block_size,
                         [(ws.block_ids, start, toks) for ws, start, toks in rows])
        return self._logits(hidden)

    def _logits(self, hidden) -> torch.Tensor:
        """The draft's logits over the target's vocabulary (a family pads its embedding rows its own way)."""
        lg = self.model.compute_logits(hidden).float()
        V = self.vocab_size
        if lg.shape[-1] >= V:
            return lg[:, :V]
        return torch.nn.functional.pad(lg, (0, V - lg.shape[-1]), value=float("-inf"))

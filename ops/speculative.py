"""Verification of speculative drafts: which drafted tokens the target model accepts.

A sequence with k drafts has k + 1 logit rows from one target forward: row j is the target's
next-token distribution p_j after the drafts before it (its sampling rows were built on that
prefix, so penalties and per-position seeds are what a step without drafts would use). Draft j
is accepted with probability min(1, p_j(d) / q_j(d)) (q: the draft's own distribution, one-hot
for n-gram drafts); the first rejected one is replaced by a draw from max(0, p_j - q_j),
normalised; when all k are accepted, row k gives one more token. The output then follows the
target's distribution exactly (Leviathan et al. 2023), and for greedy rows (p one-hot) this is
"accept while the draft equals the argmax", so greedy output is the same as without drafts.
"""
from __future__ import annotations

import torch

from ops.sampling import SamplingBatch, distribution, logprobs_of, processed, race, uniforms


def verify(logits: torch.Tensor, b: SamplingBatch, drafts: list[list[int]], q: list[torch.Tensor | None]):
    """logits [R, V]: each sequence's len(drafts[i]) + 1 rows in order; `b` has one row per logit row;
    q[i]: the draft distributions [k, V] of sequence i, or None (drafts chosen without sampling).
    Returns (tokens per sequence: its accepted drafts then one more, logprobs of those tokens or None)."""
    raw = logits
    logits = processed(logits, b)
    firsts, r = [], 0
    for d in drafts:
        firsts.append(r)
        r += len(d) + 1
    out: list[list[int]] = []
    if b.all_greedy:
        target = logits.argmax(dim=-1).tolist()
        for r0, d in zip(firsts, drafts):
            n = 0
            while n < len(d) and d[n] == target[r0 + n]:
                n += 1
            out.append(d[:n] + [target[r0 + n]])
    else:
        p = distribution(logits, b)
        u = uniforms(p.shape[0], p.shape[1] + 1, b.seeds, p.device)  # column 0 decides, the rest draw
        for i, (r0, d) in enumerate(zip(firsts, drafts)):
            toks = []
            for j, tok in enumerate(d):
                row = r0 + j
                qd = float(q[i][j, tok]) if q[i] is not None else 1.0
                if float(u[row, 0]) * qd < float(p[row, tok]):
                    toks.append(tok)
                    continue
                if q[i] is not None:
                    resid = (p[row] - q[i][j]).clamp_(min=0)
                else:
                    resid = p[row].clone()
                    resid[tok] = 0
                if not float(resid.sum()) > 0:  # p == q up to rounding: any draw from p is right
                    resid = p[row]
                toks.append(int(race(resid[None], u[row:row + 1, 1:])[0]))
                break
            else:
                row = r0 + len(d)
                toks.append(int(race(p[row:row + 1], u[row:row + 1, 1:])[0]))
            out.append(toks)
    if b.num_logprobs is None:
        return out, None
    rows = torch.tensor([r0 + j for r0, t in zip(firsts, out) for j in range(len(t))], device=raw.device)
    flat = torch.tensor([x for t in out for x in t], device=raw.device)
    return out, logprobs_of(raw[rows], flat, b.num_logprobs)

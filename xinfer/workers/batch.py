"""What the model runner and the draft model share: the persistent batch's sequence state, one
paged forward over rows of several sequences, and a step's sampling parameters."""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from ops.attention import AttnMetadata, set_context
from ops.sampling import SamplingBatch, on_device
from xinfer.sampling_params import SamplingParams


@dataclass
class WorkerSeq:
    tokens: list[int]
    num_prompt: int
    num_computed: int
    block_ids: list[int]
    params: SamplingParams
    seed: int | None
    pool_sum: torch.Tensor | None = None  # params.embed with mean pooling: float32 sum of the rows so far
    draft_computed: int = 0  # --speculative-method draft: tokens in the draft model's KV cache
    mtp_hidden: torch.Tensor | None = None  # --speculative-method mtp: the MTP head's last output [1, H]
    state_slot: int = -1  # hybrid models: its recurrent-state slot (xinfer/hybrid.py)
    mm: object = None  # a prompt with images: its workers/mm.SeqImages
    # its last token still on the device (xinfer/workers/pipeline.py): (index in tokens, the step's
    # DeviceTokens, row in them)
    pending: tuple | None = None


def drafted(ws: WorkerSeq, drafts: list[int]) -> list[WorkerSeq]:
    """The sampling rows of a sequence with drafts: row j sees the drafts before it as output."""
    return [ws] + [dataclasses.replace(ws, tokens=ws.tokens + drafts[:j]) for j in range(1, len(drafts) + 1)]


def block_table(rows, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The rows' block ids (forward's rows) as a table, a row each, in one numpy call: into `out`'s
    first rows (entries past a row's last block keep what they held), else a new zero-padded table;
    and each row's number of blocks."""
    nblk = np.fromiter((len(b) for b, _, _ in rows), dtype=np.int64, count=len(rows))
    width = int(nblk.max())
    if out is None:
        out = np.zeros((len(rows), width), dtype=np.int32)
    flat = np.fromiter(itertools.chain.from_iterable(b for b, _, _ in rows), dtype=out.dtype, count=int(nblk.sum()))
    out[:len(rows), :width][np.arange(width) < nblk[:, None]] = flat
    return out, nblk


def forward(model, backend, device, block_size: int, rows: list[tuple[list[int], int, list[int]]],
            state_slots: list[int] | None = None, state_snapshots=None, fix=None, **inputs):
    """Hidden states of `rows` (block ids, position of the first token, tokens), one sequence each,
    appended to what their KV cache holds before those positions. `inputs`: more per-row inputs of
    the model's (the MTP head's target hidden states). `state_slots`: each row's recurrent-state slot
    (hybrid models), `state_snapshots` where to copy it (xinfer/hybrid.py row_snapshots). `fix`: ids
    the step in flight is still sampling (pipeline.Fixups)."""
    bs, n = block_size, len(rows)
    # whole-batch numpy, not a few calls a row: a 256-row decode step's host time
    qlens = [len(t) for _, _, t in rows]
    ids = list(itertools.chain.from_iterable(t for _, _, t in rows))
    starts = np.fromiter((s for _, s, _ in rows), dtype=np.int64, count=n)
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(qlens, out=cu[1:])
    if len(ids) == n:  # one token a row
        row, pos = np.arange(n), starts
    else:
        row = np.repeat(np.arange(n), qlens)
        pos = starts[row] + np.arange(len(ids)) - cu[row]
    table, nblk = block_table(rows)
    ends = starts + qlens
    if (ends > nblk * bs).any():  # a padding entry would send its K/V to block 0
        i = int(np.argmax(ends > nblk * bs))
        raise ValueError(f"row {i} reaches position {ends[i] - 1} with {nblk[i]} blocks of {bs}")
    kvlens = ends.tolist()
    meta = AttnMetadata(
        cu_seqlens_q=on_device(cu, torch.int32, device),
        seq_lens=on_device(kvlens, torch.int32, device),
        block_tables=on_device(table, torch.int32, device),
        slot_mapping=on_device(table[row, pos // bs].astype(np.int64) * bs + pos % bs, torch.long, device),
        query_lens=qlens, kv_lens=kvlens, block_size=bs, state_slots=state_slots,
        state_snapshots=state_snapshots, bidirectional=getattr(inputs.get("mm"), "spans", None))
    ids_t = on_device(ids, torch.long, device)
    if fix is not None:
        fix.apply(ids_t)
    set_context(meta, backend)
    try:
        return model(ids_t, on_device(pos, torch.long, device), **inputs)
    finally:
        set_context(None)


def sampling_batch(seqs: list[WorkerSeq], vocab_size: int, eos_ids: list[int], dev) -> SamplingBatch:
    """One row per sequence (or per view of one: see `drafted`)."""
    V = vocab_size
    ps = [s.params for s in seqs]

    def col(values, dtype=torch.float32, off=None):
        if off is not None and all(v == off for v in values):
            return None
        return on_device(values, dtype, dev)

    def padded(lists):
        width = max(1, max(len(x) for x in lists))
        arr = np.full((len(lists), width), V, dtype=np.int64)
        for i, x in enumerate(lists):
            arr[i, :len(x)] = x
        return on_device(arr, torch.long, dev)

    rep = col([p.repetition_penalty for p in ps], off=1.0)
    pres = col([p.presence_penalty for p in ps], off=0.0)
    freq = col([p.frequency_penalty for p in ps], off=0.0)
    bias_rows, bias_ids, bias_vals, ban_rows, ban_ids, seeds = [], [], [], [], [], []
    ok_rows, ok_ids = [], []
    for i, (s, p) in enumerate(zip(seqs, ps)):
        # the outputs counted, copied only where read: a copy of them all each step grows with their length
        n_out = len(s.tokens) - s.num_prompt
        for tid, v in (p.logit_bias or {}).items():
            bias_rows.append(i), bias_ids.append(int(tid)), bias_vals.append(float(v))
        if n_out < p.min_tokens:
            for tid in set(([] if p.ignore_eos else eos_ids) + list(p.stop_token_ids)):
                ban_rows.append(i), ban_ids.append(tid)
        for bad in p.bad_words_ids:  # its last token, where the output ends with the rest of it
            if len(bad) == 1 or (len(bad) - 1 <= n_out and s.tokens[len(s.tokens) - len(bad) + 1:] == bad[:-1]):
                ban_rows.append(i), ban_ids.append(bad[-1])
        if p.allowed_token_ids:
            ok_rows.extend([i] * len(p.allowed_token_ids)), ok_ids.extend(p.allowed_token_ids)
        if s.seed is not None:
            # the noise for output position k depends only on (seed, k)
            seeds.append((i, s.seed * 1_000_003 + n_out))
    top_k = [min(p.top_k, V) if p.top_k > 0 else V for p in ps]
    return SamplingBatch(
        temperature=on_device([p.temperature for p in ps], torch.float32, dev),
        top_k=col(top_k, torch.long, off=V), top_p=col([p.top_p for p in ps], off=1.0),
        min_p=col([p.min_p for p in ps], off=0.0),
        repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq,
        output_ids=padded([s.tokens[s.num_prompt:] for s in seqs]) if (rep is not None or pres is not None or freq is not None) else None,
        prompt_ids=padded([s.tokens[:s.num_prompt] for s in seqs]) if rep is not None else None,
        bias=(on_device(bias_rows, torch.long, dev), on_device(bias_ids, torch.long, dev),
              on_device(bias_vals, torch.float32, dev)) if bias_rows else None,
        banned=(on_device(ban_rows, torch.long, dev), on_device(ban_ids, torch.long, dev)) if ban_rows else None,
        allowed=(on_device(ok_rows, torch.long, dev), on_device(ok_ids, torch.long, dev)) if ok_rows else None,
        seeds=seeds, all_greedy=all(p.greedy for p in ps), top_k_max=max((k for k in top_k if k < V), default=0),
        any_zero_temp=any(p.temperature == 0.0 for p in ps),
        num_logprobs=max((p.logprobs for p in ps if p.logprobs is not None), default=None))

"""Batched sampling on the device: every request in the batch has its own parameters,
and nothing goes back to the host per request.

Order of logit processing: logit bias and min-tokens masking, repetition penalty
(prompt and output tokens), presence/frequency penalties (output tokens), then
temperature, top-k, top-p and min-p. Each row is drawn by the inverse CDF of its distribution
with one U(0, 1) (on a CPU without top-k, top-p or min-p, in one C call: cpu_kernels.sample); a
seeded request draws it from its own generator, seeded by (seed, output position), so its tokens
depend on nothing else in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ops import cpu_kernels

_MASK64 = (1 << 63) - 1


def on_device(values, dtype, device) -> torch.Tensor:
    """A tensor of host values on `device`. On CUDA through pinned memory, copied without blocking:
    a plain copy from pageable memory waits for the kernels queued before it (a decode graph), so
    the host could not build the step's sampling inputs while the graph runs."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [B] float; 0 = greedy
    top_k: torch.Tensor | None  # [B] long, vocab size = off
    top_p: torch.Tensor | None  # [B] float
    min_p: torch.Tensor | None  # [B] float
    repetition_penalty: torch.Tensor | None  # [B]
    presence_penalty: torch.Tensor | None  # [B]
    frequency_penalty: torch.Tensor | None  # [B]
    output_ids: torch.Tensor | None  # [B, L] long, padded with vocab size (ignored)
    prompt_ids: torch.Tensor | None  # [B, Lp] long, padded with vocab size
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, token ids, values
    banned: tuple[torch.Tensor, torch.Tensor] | None  # rows, token ids set to -inf (min_tokens, bad words)
    seeds: list[tuple[int, int]]  # (row, per-step seed) for seeded rows
    all_greedy: bool
    num_logprobs: int | None  # max top-k alternatives asked for in the batch; None = no logprobs
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None  # rows restricted to these (row, token id) pairs
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, int32 bitmask words [R, ceil(V/32)]
    top_k_max: int = 0  # the largest top_k of a row that has one (host side: no sync to size the candidates)
    any_zero_temp: bool = True  # a row at temperature 0 (host side): False skips their argmax over the batch


def allowed_by_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmask words [R, W] (bit j of word i: token 32 i + j allowed) -> bool [R, vocab_size]."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words[:, :, None] >> shifts) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    B, V = logits.shape
    if b.grammar is not None:  # structured outputs first: what the grammar rules out never comes back
        rows, words = b.grammar
        logits[rows] = logits[rows].masked_fill(~allowed_by_bitmask(words, V), float("-inf"))
    if b.bias is not None:
        rows, ids, vals = b.bias
        logits.index_put_((rows, ids), vals, accumulate=True)
    if b.banned is not None:
        logits[b.banned] = float("-inf")
    if b.allowed is not None:
        rows, ids = b.allowed
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[rows, ids] = True
        restricted = torch.zeros(B, dtype=torch.bool, device=logits.device)
        restricted[rows] = True
        logits = logits.masked_fill(restricted[:, None] & ~keep, float("-inf"))
    if b.repetition_penalty is not None:
        seen = torch.zeros(B, V + 1, dtype=torch.bool, device=logits.device)
        for ids in (b.prompt_ids, b.output_ids):
            if ids is not None:
                seen.scatter_(1, ids, True)
        seen = seen[:, :V]
        rp = b.repetition_penalty[:, None]
        penalised = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(seen, penalised, logits)
    if (b.presence_penalty is not None or b.frequency_penalty is not None) and b.output_ids is not None:
        counts = torch.zeros(B, V + 1, dtype=logits.dtype, device=logits.device)
        counts.scatter_add_(1, b.output_ids, torch.ones_like(b.output_ids, dtype=logits.dtype))
        counts = counts[:, :V]
        if b.frequency_penalty is not None:
            logits = logits - b.frequency_penalty[:, None] * counts
        if b.presence_penalty is not None:
            logits = logits - b.presence_penalty[:, None] * (counts > 0).to(logits.dtype)
    return logits


def processed(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """The logits after every processor that changes them (on a copy: logprobs read the raw ones)."""
    if (b.grammar is not None or b.bias is not None or b.banned is not None or b.allowed is not None
            or b.repetition_penalty is not None
            or b.presence_penalty is not None or b.frequency_penalty is not None):
        return apply_penalties(logits.clone(), b)
    return logits


def uniforms(rows: int, width: int, seeds: list[tuple[int, int]], device) -> torch.Tensor:
    """U(0, 1) [rows, width]; a seeded row's come from its per-step seed alone (seeded_uniforms)."""
    u = torch.empty(rows, width, device=device).uniform_()
    if seeds:
        idx = on_device([r for r, _ in seeds], torch.long, device)
        u[idx] = seeded_uniforms(on_device([s & _MASK64 for _, s in seeds], torch.int64, device), width)
    return u


def _i64(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    return (z >> k) & ((1 << (64 - k)) - 1)  # int64 shifts in torch keep the sign: a logical shift


def seeded_uniforms(seeds: torch.Tensor, width: int) -> torch.Tensor:
    """U(0, 1) [R, width] from each row's int64 seed: splitmix64 of seed + (j + 1) * golden ratio
    (wrapping int64 arithmetic), its top 23 bits. A counter-based draw: a batch of seeded rows costs a
    few kernels, not a generator per row (on a GPU, 256 rows of those took longer than the step)."""
    j = torch.arange(1, width + 1, dtype=torch.int64, device=seeds.device)
    z = seeds[:, None] + j[None, :] * _GOLDEN
    z = (z ^ _srl(z, 30)) * _MIX1
    z = (z ^ _srl(z, 27)) * _MIX2
    z = z ^ _srl(z, 31)
    return (_srl(z, 41) * 2 + 1).to(torch.float32) * (1.0 / (1 << 24))  # odd multiples of 2^-24: exact


def race(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """A draw from each row of `probs` (any scale): argmax(p / E) with E = -log(U) ~ Exp(1).
    torch's exponential_ is ~6x slower on the CPU (1 ms for a 49k vocabulary); U < 1, so E > 0."""
    return (probs / u.log().neg_()).argmax(dim=-1)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """A draw from each row of `probs` (any scale) by its inverse CDF, one U(0, 1) a row ([B, 1]):
    a cumulative sum and a binary search instead of one random number, a log and a division per
    token as `race` takes (at 64 rows of a 49k vocabulary on two cores: ~6 ms against ~30)."""
    cdf = probs.cumsum(dim=-1)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]  # the first token whose cdf passes u
    return idx.clamp_(max=probs.shape[-1] - 1)


def distribution(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """The normalised distribution each row samples from (processed logits in): temperature, top-k,
    top-p, min-p; a greedy row is one-hot on its argmax."""
    temp = b.temperature.clamp(min=1e-5)[:, None]
    probs = _filter(torch.softmax(logits / temp, dim=-1), b)
    greedy = b.temperature == 0
    if bool(greedy.any()):
        probs[greedy] = torch.nn.functional.one_hot(logits[greedy].argmax(-1), logits.shape[-1]).to(probs.dtype)
    return probs / probs.sum(dim=-1, keepdim=True)


def logprobs_of(raw: torch.Tensor, tokens: torch.Tensor, k: int):
    """(chosen [B], top ids [B, k] or None, top values or None) under the raw distribution."""
    lp = torch.log_softmax(raw, dim=-1)
    chosen = lp.gather(1, tokens[:, None])[:, 0]
    top = lp.topk(k, dim=-1) if k > 0 else None
    return chosen, top.indices if top is not None else None, top.values if top is not None else None


def sample(logits: torch.Tensor, b: SamplingBatch):
    """logits [B, V] float32 -> (token ids [B], logprobs or None).
    logprobs are from the model's raw distribution: (chosen [B], top ids [B, k], top values [B, k])."""
    raw = logits
    logits = processed(logits, b)
    if b.all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        u = uniforms(logits.shape[0], 1, b.seeds, logits.device)
        # no filter: on a CPU, the draw without the probabilities (one C pass instead of four over the rows)
        plain = b.top_k is None and b.top_p is None and b.min_p is None
        tokens = cpu_kernels.sample(logits, b.temperature, u) if plain else None
        if tokens is None:
            temp = b.temperature.clamp(min=1e-5)[:, None]
            tokens = draw(_filter(torch.softmax(logits / temp, dim=-1), b), u)
        # the host's flag, not a check of the tensor: that would wait for the device (pipeline.py)
        if b.any_zero_temp:
            tokens = torch.where(b.temperature == 0, logits.argmax(dim=-1), tokens)
    if b.num_logprobs is None:
        return tokens, None
    return tokens, logprobs_of(raw, tokens, b.num_logprobs)


CANDIDATES = 256  # top-k / top-p look at each row's largest this many probabilities first


def _filter(probs: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    if b.top_k is not None or b.top_p is not None:
        cand = max(CANDIDATES, (b.top_k_max or probs.shape[-1]) if b.top_k is not None else 0)
        probs = _nucleus(probs, b.top_k, b.top_p) if cand >= probs.shape[-1] else _nucleus_of(probs, b, cand)
    if b.min_p is not None:
        probs = probs.masked_fill(probs < b.min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def _cut(sorted_p, top_k, top_p, mass=None):
    """Each row's largest probabilities in descending order (all of them, or the first few), zeroed
    past its top-k and then past its top-p nucleus. `mass`: each row's whole mass after top-k, where
    not all of it is here."""
    if top_k is not None:
        ranks = torch.arange(sorted_p.shape[-1], device=sorted_p.device)[None, :]
        sorted_p = sorted_p.masked_fill(ranks >= top_k[:, None], 0.0)
    if top_p is not None:
        norm = sorted_p / (sorted_p.sum(dim=-1, keepdim=True) if mass is None else mass)
        before = norm.cumsum(dim=-1) - norm  # mass of strictly better tokens, after top-k
        sorted_p = sorted_p.masked_fill(before >= top_p[:, None], 0.0)
    return sorted_p


def _nucleus(probs, top_k, top_p):
    """top-k and top-p over a full sort of each row."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    return torch.zeros_like(probs).scatter_(1, order, _cut(sorted_p, top_k, top_p))


def _nucleus_of(probs, b: SamplingBatch, cand: int):
    """top-k and top-p from each row's `cand` largest probabilities (a partial top-k, not a sort of
    the vocabulary: 64 rows of 49k take 7 ms against 126 on two cores); `cand` covers every top-k, and
    a row whose top-p nucleus reaches past them is sorted whole."""
    vals, order = probs.topk(cand, dim=-1)
    V = probs.shape[-1]
    limited = b.top_k < V if b.top_k is not None else torch.zeros(len(probs), dtype=torch.bool, device=probs.device)
    kept = vals if b.top_k is None else _cut(vals, b.top_k, None)
    mass = torch.where(limited[:, None], kept.sum(dim=-1, keepdim=True), probs.sum(dim=-1, keepdim=True))
    cut = _cut(kept, None, b.top_p, mass)
    out = torch.zeros_like(probs).scatter_(1, order, cut)
    if b.top_p is None:
        return torch.where(limited[:, None], out, probs)
    whole = ~limited & (b.top_p >= 1.0)  # neither top-k nor top-p: the row as it is
    out = torch.where(whole[:, None], probs, out)
    # the first token past the candidates has all of them before it: cut where they reach top-p
    reach = (kept / mass).sum(dim=-1)
    beyond = ~(limited | whole | (reach >= b.top_p))
    if bool(beyond.any()):
        rows = beyond.nonzero()[:, 0]
        out[rows] = _nucleus(probs[rows], None if b.top_k is None else b.top_k[rows], b.top_p[rows])
    return out

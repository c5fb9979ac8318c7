"""The scheduler: owns every sequence's state and decides each step's batch.

There are no prefill or decode phases: each step, every running sequence's computed
tokens catch up with its known tokens under one token budget, running sequences first,
then waiting ones in arrival order. Long prompts are cut into chunks. When the KV cache
runs out, the most recently admitted sequence is preempted: its blocks are freed and it
is recomputed later from the tokens it already has, so no request fails on a full cache.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from xinfer import spec
from xinfer.config import EngineConfig
from xinfer.ipc.media import whole_images
from xinfer.ipc.step import NewSeq, Scheduled, StepPlan, StepResult, pack_ids, unpack_ids
from xinfer.kv_cache import BlockManager, block_hash
from xinfer.sampling_params import SamplingParams

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int | None
    max_tokens: int
    arrival_time: float = field(default_factory=time.time)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)  # for prompt tokens 1.. (token 0 has none)
    scheduled_time: float | None = None  # first admitted to the running batch
    status: str = WAITING
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_cached_tokens: int | None = None  # prefix-cache hits at first admission
    on_worker: bool = False
    finish_reason: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    spec_k: int = 0  # speculative decoding: drafts to ask for next step (0: --num-speculative-tokens)
    children: list["Sequence"] = field(default_factory=list)  # n > 1 siblings waiting for the prompt
    index: int = 0  # which of its request's n choices
    strikes: int = 0  # failed steps it was in (a worker crash or a step that raised)
    error: str | None = None  # why it ended with finish_reason "error"
    grammar: object = None  # structured outputs: its xgrammar matcher, advanced with every token
    embedding: bytes = b""  # params.embed: the pooled vector (float32 bytes) once its prompt ran
    state_slot: int = -1  # hybrid models: its recurrent-state slot while on the worker (xinfer/hybrid.py)
    images: list = field(default_factory=list)  # the prompt's ImageData (xinfer/ipc/media.py)

    @property
    def cache_keys(self) -> list:
        """What the prefix cache hashes: the tokens, an image's placeholders as (its content hash,
        index) pairs, so two images never share KV."""
        keys = self.tokens
        for im in self.images:
            keys[im.offset:im.offset + im.length] = [(im.hash, j) for j in range(im.length)]
        return keys

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager, max_model_len: int, eos_ids: list[int],
                 spec_method: str | None = None, state_slots=None):
        self.config = config
        self.slots = state_slots  # hybrid.StateSlots, or None: the model keeps no recurrent state
        self.spec_method = spec_method  # speculative decoding: "ngram", "draft", or None (off)
        self.num_draft_tokens = self.num_accepted_tokens = self.num_spec_steps = 0
        self.bm = blocks
        self.max_model_len = max_model_len
        self.eos_ids = set(eos_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[int, Sequence] = {}
        self._dropped: list[int] = []
        self._inflight: deque[list] = deque()  # each step sent and not yet updated: (seq, n, blocks, k, drafts)
        self._step = 0
        self.num_preemptions = 0
        # Sequences that were in a failed step run alone, one at a time, until each has sampled a
        # token in a step of its own: the one that fails again is the cause (see EngineCore).
        self.suspects: list[Sequence] = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence, siblings: list[Sequence] = ()) -> None:
        self.seqs[seq.seq_id] = seq
        for s in siblings:
            self.seqs[s.seq_id] = s
        seq.children = list(siblings)
        self.waiting.append(seq)

    def abort(self, seq_id: int, reason: str = "abort") -> Sequence | None:
        seq = self.seqs.get(seq_id)
        if seq is None or seq.status == FINISHED:
            return None
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, reason)
        return seq

    # ---- scheduling ----
    def can_schedule_ahead(self) -> bool:
        """Whether the next step can be planned while the one in flight runs (overlap): only when
        no sequence needs that step's tokens to plan it (drafts, grammar masks, a recurrent state,
        a suspect running alone) and one step at most is in flight."""
        return (len(self._inflight) == 1 and self.spec_method is None and self.slots is None and not self.suspects
                and not any(s.grammar is not None for q in (self.running, self.waiting) for s in q))

    def schedule(self, ahead: bool = False) -> StepPlan:
        """`ahead`: while the step in flight runs (can_schedule_ahead), on the assumption that each
        of its sampling sequences gets one token; one that surely ends there (its max_tokens, the
        context) is left out, one that ends on a stop token computes one token for nothing, and no
        sequence is preempted (what does not fit waits a step)."""
        if not ahead:  # planned in order, nothing is in flight: drop what a step cut short (Ctrl-C) left
            self._inflight.clear()
        prev = {s.seq_id: n for s, n, *_ in self._inflight[-1]} if ahead else {}
        budget = self.config.max_num_batched_tokens
        # the chunk cap keeps decoding sequences' tokens coming and lets short prompts in beside a long
        # one; a prompt alone may take more (EngineConfig.prefill_chunk_alone)
        chunk = self.config.prefill_chunk_size
        if len(self.running) + len(self.waiting) == 1:
            chunk = self.config.prefill_chunk_alone or chunk
        scheduled: list[tuple[Sequence, int, list[int], int, bytes]] = []  # seq, tokens, blocks, drafts
        new_seqs: list[NewSeq] = []
        copies: list[tuple[int, int, int]] = []  # a prefix-cache hit inside a block: (src, dst, slots)
        self.suspects = [s for s in self.suspects if s in self.running or s in self.waiting]
        alone = self.suspects[0] if self.suspects else None
        if alone is not None and alone.status == WAITING and self.waiting[0] is not alone:
            self.waiting.remove(alone)
            self.waiting.appendleft(alone)

        limit = self.config.speculative_disable_by_batch_size
        speculate = self.spec_method is not None and (not limit or len(self.running) <= limit)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if alone is not None and seq is not alone:
                i += 1
                continue
            computed, total = seq.num_computed + prev.get(seq.seq_id, 0), seq.num_tokens
            if computed == total and seq.seq_id in prev:  # it samples in the step in flight
                if len(seq.output_ids) + 1 >= seq.max_tokens or total + 1 >= self.max_model_len:
                    i += 1
                    continue
                total += 1
            n = min(total - computed, chunk, budget)
            if seq.images:  # Gemma 3's images are computed in one chunk each
                n = whole_images(seq.images, computed, n)
            drafts = self._drafts(seq, budget) if speculate else None
            if drafts is not None:
                k = len(drafts) if self.spec_method == "ngram" else seq.spec_k or self.config.num_speculative_tokens
                k = min(k, seq.max_tokens - len(seq.output_ids) - 1, self.max_model_len - seq.num_tokens - 1, budget - 1)
                new_blocks = self._grow(seq, 1 + k) if k > 0 else None
                if new_blocks is not None:
                    scheduled.append((seq, 1, new_blocks, k, pack_ids(drafts[:k]) if drafts else b""))
                    budget -= 1 + k
                    i += 1
                    continue
            new_blocks = self._grow(seq, n, computed)
            while new_blocks is None and not ahead:  # out of blocks: preempt from the back until this one fits
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
                new_blocks = self._grow(seq, n)
            if new_blocks is None:
                break
            scheduled.append((seq, n, new_blocks, 0, b""))
            budget -= n
            i += 1

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if alone is not None and seq is not alone:
                break
            # Cached blocks have no logits or hidden states: a sequence that scores or embeds its prompt
            # computes it all (its blocks are still registered for the requests after it).
            matched = not seq.block_ids and seq.params.prompt_logprobs is None and not seq.params.embed
            partial = self._match_prefix(seq) if matched else None
            n = min(seq.num_tokens - seq.num_computed, chunk, budget)
            if seq.images:  # Gemma 3's images are computed in one chunk each
                n = whole_images(seq.images, seq.num_computed, n)
            new_blocks = self._grow(seq, n)
            if new_blocks is None:
                if matched:  # a waiting sequence holds no blocks: give the prefix back
                    self.bm.release(seq.block_ids)
                    seq.block_ids, seq.block_hashes, seq.num_computed = [], [], 0
                break
            if partial is not None:  # its next block starts with a cached block's first slots
                copies.append((partial[0], seq.block_ids[len(seq.block_hashes)], partial[1]))
            if matched and seq.num_cached_tokens is None:  # admitted: its hits count (not a failed try's)
                seq.num_cached_tokens = seq.num_computed
            self.waiting.popleft()
            seq.status = RUNNING
            if seq.scheduled_time is None:
                seq.scheduled_time = time.time()
            self.running.append(seq)
            if not seq.on_worker:
                seq.on_worker = True
                if self.slots is not None:
                    seq.state_slot = self.slots.take()
                new_seqs.append(NewSeq(seq.seq_id, pack_ids(seq.tokens), len(seq.prompt_ids), seq.num_computed,
                                       list(seq.block_ids), seq.params, seq.seed, seq.state_slot,
                                       seq.images))
                new_blocks = []
            scheduled.append((seq, n, new_blocks, 0, b""))
            budget -= n

        self._step += 1
        # hybrids: the recurrent-state snapshots this step restores and captures (xinfer/hybrid.py)
        states = {} if self.slots is None else self.slots.plan(scheduled, new_seqs, self.bm.block_size, self.bm.cached)
        plan = StepPlan(self._step, new_seqs, [Scheduled(s.seq_id, n, b, k, d) for s, n, b, k, d in scheduled],
                        self._dropped, kv_copies=copies, **states)
        self._dropped = []
        self._inflight.append(scheduled)
        return plan

    def cancel(self, plan: StepPlan) -> None:
        """Take back the last plan, unsent: it had nothing to do (an ahead plan whose sequences all end)."""
        assert not (plan.scheduled or plan.new_seqs or plan.dropped) and plan.step_id == self._step
        self._inflight.pop()
        self._step -= 1

    def _drafts(self, seq: Sequence, budget: int) -> list[int] | None:
        """A decoding sequence's n-gram drafts ([] for the draft model's: the worker proposes them);
        None when it does not speculate this step."""
        if (seq.num_tokens - seq.num_computed != 1 or budget < 2 or seq.grammar is not None
                or seq.params.embed or seq.max_tokens - len(seq.output_ids) < 2):
            return None
        if self.spec_method != "ngram":
            return []
        c = self.config
        return spec.ngram_propose(seq.tokens, seq.spec_k or c.num_speculative_tokens, c.ngram_min, c.ngram_max) or None

    def _grow(self, seq: Sequence, n: int, computed: int | None = None) -> list[int] | None:
        """Blocks so that `n` more tokens fit after `computed` (default: what it has computed);
        None when the cache can't give them."""
        computed = seq.num_computed if computed is None else computed
        need = -(-(computed + n) // self.bm.block_size) - len(seq.block_ids)
        if need <= 0:
            return []
        got = self.bm.allocate(need)
        if got is not None:
            seq.block_ids.extend(got)
        return got

    def _match_prefix(self, seq: Sequence) -> tuple[int, int] | None:
        """Take the cached blocks `seq` starts with; returns (cached block, n) when its next n tokens
        are that block's first n too (the worker copies them), else None."""
        keys, bs = seq.cache_keys, self.bm.block_size
        blocks, hashes = self.bm.match_prefix(keys)
        # Recompute at least the last token: its logits are what we sample from.
        while blocks and len(blocks) * bs >= seq.num_tokens:
            blocks.pop(), hashes.pop()
        if self.slots is not None:  # a hybrid resumes from a recurrent-state snapshot: cut back to one
            k = self.slots.resume(seq.seq_id, hashes)
            blocks, hashes = blocks[:k], hashes[:k]
        self.bm.acquire(blocks)
        seq.block_ids, seq.block_hashes = list(blocks), list(hashes)
        seq.num_computed = len(blocks) * bs
        src, n = None, 0
        # not for a hybrid (its snapshots are at block ends) nor images (a span is computed whole)
        if self.slots is None and not seq.images:
            src, n = self.bm.match_partial(hashes[-1] if hashes else None,
                                           keys[seq.num_computed:min(seq.num_computed + bs, seq.num_tokens - 1)])
            seq.num_computed += n
        return (src, n) if n else None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.bm.release(seq.block_ids)
        seq.block_ids, seq.block_hashes, seq.num_computed = [], [], 0
        if seq.on_worker:
            self._dropped.append(seq.seq_id)
            seq.on_worker = False
        if seq.state_slot >= 0:  # its recurrent state goes with its KV: a recompute rebuilds both
            self.slots.give(seq.state_slot)
            seq.state_slot = -1

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == RUNNING:
            self.running.remove(seq)
        self._release(seq)
        seq.status = FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.time()
        self.seqs.pop(seq.seq_id, None)
        self._release_children(seq)

    def reset_worker_state(self) -> None:
        """The worker and its KV cache are gone: every sequence will be recomputed from its
        tokens (running ones first, in their order), and no cached block is valid any more."""
        self._inflight.clear()
        self._dropped = []
        for seq in reversed(self.running):
            self._release(seq)
            seq.status = WAITING
            self.waiting.appendleft(seq)
        self.running = []
        for seq in self.waiting:  # n > 1 siblings may hold their parent's prompt blocks
            self._release(seq)
        self._dropped = []
        self.bm.forget_cached()
        if self.slots is not None:
            self.slots.forget()

    # ---- results ----
    def update(self, result: StepResult) -> list[tuple[Sequence, list[int] | None]]:
        """Apply a step's sampled tokens; returns (sequence, its new tokens) pairs in batch order
        (None: a prompt-only sequence that is done)."""
        counts = result.counts or [1] * len(result.seq_ids)
        flat, new, at = unpack_ids(result.token_ids), {}, 0
        for sid, c in zip(result.seq_ids, counts):
            new[sid], at = (at, flat[at:at + c]), at + c
        for seq, n, _, k, _ in self._inflight.popleft():
            if seq.status == RUNNING:
                seq.num_computed += n
                if k:  # the accepted drafts' KV is kept; blocks past the last valid token go back
                    accepted = len(new[seq.seq_id][1]) - 1 if seq.seq_id in new else 0
                    seq.num_computed += accepted
                    self.num_draft_tokens += k
                    self.num_accepted_tokens += accepted
                    self.num_spec_steps += 1
                    # Verifying a draft costs compute whether it is kept or not: ask for more while they
                    # are all accepted (a copied passage), fewer after a miss
                    seq.spec_k = min(2 * k, self.config.num_speculative_tokens) if accepted == k else max(1, accepted)
                    keep = spec.blocks_needed(seq.num_computed, self.bm.block_size)
                    self.bm.release(seq.block_ids[keep:])
                    del seq.block_ids[keep:]
                self._register_full_blocks(seq)
        if self.slots is not None:
            self.slots.commit()
        for sid, first, entries in result.prompt_logprobs:
            seq = self.seqs.get(sid)
            if seq is not None and len(seq.prompt_logprobs) + 1 == first:  # not again after a recompute
                seq.prompt_logprobs.extend(entries)
        for sid, vec in result.embeddings:
            seq = self.seqs.get(sid)
            if seq is not None:
                seq.embedding = vec
        now = time.time()
        out = []
        for sid, (at, toks) in new.items():
            seq = self.seqs.get(sid)
            if seq is None or seq.status != RUNNING:
                continue  # aborted while the step ran
            if seq.max_tokens == 0:  # ran only to score or embed the prompt
                self._finish(seq, "length")
                out.append((seq, None))
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
                self._release_children(seq)
            kept = []
            for j, tok in enumerate(toks):
                kept.append(tok)
                seq.output_ids.append(tok)
                if result.logprobs and result.logprobs[at + j] is not None:
                    seq.logprobs.append(result.logprobs[at + j])
                reason = self._stop_reason(seq, tok)
                if reason:
                    self._finish(seq, reason)
                    break
            if self.suspects and self.suspects[0] is seq:  # it ran alone through a whole step: not the cause
                self.suspects.pop(0)
            out.append((seq, kept))
        return out

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        n = len(seq.output_ids)
        if n >= p.min_tokens:
            if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                return "stop"
        if n >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _register_full_blocks(self, seq: Sequence) -> None:
        if not self.bm.enable_prefix_cache:
            return
        bs = self.bm.block_size
        full = seq.num_computed // bs
        toks = None
        for i in range(len(seq.block_hashes), full):
            toks = toks or seq.cache_keys
            parent, chunk = seq.block_hashes[-1] if seq.block_hashes else None, toks[i * bs:(i + 1) * bs]
            h = block_hash(parent, chunk)
            self.bm.register(seq.block_ids[i], h, parent, chunk)
            seq.block_hashes.append(h)

    def _release_children(self, parent: Sequence) -> None:
        """n > 1: siblings start once the prompt is in the cache, sharing its full blocks."""
        if not parent.children:
            return
        bs = self.bm.block_size
        # a hybrid's blocks hold no recurrent state: its siblings go through the prefix cache's snapshots
        k = (len(parent.prompt_ids) - 1) // bs if parent.status == RUNNING and self.slots is None else 0
        for child in reversed(parent.children):
            if k:
                child.block_ids = parent.block_ids[:k]
                child.block_hashes = parent.block_hashes[:k]
                self.bm.acquire(child.block_ids)
                child.num_computed = k * bs
                child.num_cached_tokens = k * bs
            self.waiting.appendleft(child)
        parent.children = []

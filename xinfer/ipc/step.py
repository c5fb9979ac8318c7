"""Scheduler <-> worker messages: one StepPlan per step, one StepResult back.

Workers keep a persistent batch: a sequence's tokens, blocks and sampling params are
sent once (NewSeq), and afterwards only what changed (new blocks, how many tokens to
compute). Token ids travel as raw int32 bytes.
"""
from __future__ import annotations

import msgspec
import numpy as np

from xinfer.ipc.media import ImageData
from xinfer.sampling_params import SamplingParams


def pack_ids(ids) -> bytes:
    return np.asarray(ids, dtype=np.int32).tobytes()


def unpack_ids(buf: bytes) -> list[int]:
    return np.frombuffer(buf, dtype=np.int32).tolist()


class NewSeq(msgspec.Struct, array_like=True):
    seq_id: int
    token_ids: bytes  # every known token: prompt + output so far (recompute after preemption)
    num_prompt_tokens: int
    num_computed: int  # tokens already in the KV cache (prefix-cache hits)
    block_ids: list[int]
    params: SamplingParams
    seed: int | None  # this sequence's seed (n > 1 siblings get distinct ones)
    state_slot: int = -1  # hybrid models: its slot in the worker's recurrent-state pool (xinfer/hybrid.py)
    images: list[ImageData] = []  # the prompt's images (xinfer/ipc/media.py)


class Scheduled(msgspec.Struct, array_like=True):
    seq_id: int
    num_tokens: int  # tokens to compute this step, from the sequence's num_computed on
    new_block_ids: list[int]
    # Speculative decoding: this many draft tokens follow the sequence's last token and are verified
    # in the same forward (their KV slots are in the blocks). `draft_ids`: the drafts themselves
    # (n-gram, proposed by the scheduler); empty: the worker's draft model proposes them.
    num_spec: int = 0
    draft_ids: bytes = b""


class StepPlan(msgspec.Struct, array_like=True, tag="plan"):
    step_id: int
    new_seqs: list[NewSeq]
    scheduled: list[Scheduled]  # in batch order; NewSeqs are scheduled here too
    dropped: list[int]  # finished or preempted: forget them
    # Structured outputs: the sequences sampling under a grammar this step, and their allowed
    # tokens as int32 bitmask rows (ceil(vocab / 32) words each, bit set: allowed), in that order
    mask_seq_ids: list[int] = []
    masks: bytes = b""
    # Hybrid models (xinfer/hybrid.py): before the step, copy snapshot slot -> the new sequence's state
    # slot (seq id, snapshot slot); during it, copy the sequence's state after `position` tokens into
    # the snapshot slot (seq id, position, snapshot slot)
    state_restores: list[tuple[int, int]] = []
    state_snapshots: list[tuple[int, int, int]] = []
    # A prefix-cache hit inside a block (xinfer/kv_cache.py): before the step, copy the first n slots
    # of cached block src into the sequence's own block dst (src, dst, n)
    kv_copies: list[tuple[int, int, int]] = []


class StepResult(msgspec.Struct, array_like=True, tag="result"):
    step_id: int
    seq_ids: list[int]  # the sequences that sampled a token this step, in batch order
    token_ids: bytes  # every sequence's new tokens, in seq_ids order
    # Per sampled token, when asked: (chosen logprob, [(token id, logprob), ...] top alternatives)
    logprobs: list[tuple[float, list[tuple[int, float]]] | None] = []
    # Prompt logprobs computed this step: (seq id, position of the first scored token, entries), each
    # entry (logprob, top alternatives, the token's rank)
    prompt_logprobs: list[tuple[int, int, list[tuple[float, list[tuple[int, float]], int]]]] = []
    error: str | None = None  # the step raised: nothing was computed, the worker's batch is cleared
    # Embedding sequences whose prompt finished this step: (seq id, the pooled, L2-normalised final
    # hidden state as raw float32 bytes)
    embeddings: list[tuple[int, bytes]] = []
    # Speculative decoding: how many of token_ids each sequence got (its accepted drafts and one more);
    # empty: one each
    counts: list[int] = []

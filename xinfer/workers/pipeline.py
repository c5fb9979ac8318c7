"""Pipelined steps: the worker launches step N + 1 before it reads step N's tokens, so the device
runs one step while the host finishes the one before (vLLM's async scheduling).

A step's sampled tokens stay on the device; each sampling sequence gets a placeholder (PENDING) at
the end of its tokens, which the step's finish replaces. Step N + 1, launched meanwhile, takes the
input token of such a sequence from the device (`Fixups`): its ids are written with the placeholder
and patched on the device before the forward. On CUDA the tokens come back through pinned memory
with an event, so nothing blocks until the finish asks for them.

The scheduler plans step N + 1 ahead of step N's result (overlap scheduling), so this needs it on.
A step is launched early only when nothing in it reads an output token's value on the host: no
drafts, no grammar masks, no repetition, presence or frequency penalty and no bad words.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ops.sampling import on_device

PENDING = -1  # a sampled token not yet on the host


class DeviceTokens:
    """Sampled token ids [n] on their way to the host."""

    def __init__(self, tokens: torch.Tensor):
        self.dev = tokens
        self.event = None
        if tokens.is_cuda:
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(tokens.device))  # the tokens' device, not the current one
        else:
            self.host = tokens

    def done(self) -> bool:
        """Whether the device has finished the step that sampled them (without waiting)."""
        return self.event is None or self.event.query()

    def tolist(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class Fixups:
    """The input ids of a step that are still PENDING on the host: (flat position, row in the
    launched step's tokens), all from one step (two are in flight at most)."""

    def __init__(self):
        self.pos: list[int] = []
        self.src: list[int] = []
        self.tokens: DeviceTokens | None = None

    def add(self, ws, start: int, end: int, offset: int) -> None:
        """ws's tokens [start, end) go to flat positions offset...: note its pending one if there."""
        if ws.pending is None:
            return
        idx, tokens, row = ws.pending
        if start <= idx < end:
            assert self.tokens is None or self.tokens is tokens, "pending tokens of two steps"
            self.tokens = tokens
            self.pos.append(offset + idx - start)
            self.src.append(row)

    def apply(self, ids: torch.Tensor) -> None:
        """Patch the device ids in place (stream-ordered after the step that samples them)."""
        if self.pos:
            dev = ids.device
            ids[on_device(self.pos, torch.long, dev)] = self.tokens.dev[on_device(self.src, torch.long, dev)]


@dataclass
class Launched:
    """A step sent to the device, its tokens not yet read. `error`: it failed before or while it
    launched (its result says so)."""
    plan: object
    error: str | None = None
    seqs: dict = field(default_factory=dict)  # seq id -> WorkerSeq, as at launch
    sample_seqs: list[int] = field(default_factory=list)
    plain: list[int] = field(default_factory=list)  # sequences sampled without drafts, in row order
    tokens: DeviceTokens | None = None
    placeholders: dict = field(default_factory=dict)  # seq id -> index of its PENDING token
    logprobs: tuple | None = None  # the plain rows' (chosen, top ids, top values) on the device
    spec: tuple = ({}, {})  # drafted sequences' tokens and logprobs (verified at launch)
    drafts: dict = field(default_factory=dict)
    first_row: dict = field(default_factory=dict)
    hidden: torch.Tensor | None = None
    prompt_lps: list = field(default_factory=list)
    embeddings: list = field(default_factory=list)


def can_follow(prev: Launched, plan, seqs: dict) -> bool:
    """Whether `plan` can launch while `prev` is in flight: nothing in either reads a token on the
    host that `prev` has not given back yet."""
    if (prev.error is not None or prev.drafts or prev.plan.mask_seq_ids or plan.mask_seq_ids or plan.state_restores
            or any(s.num_spec or s.draft_ids for s in plan.scheduled)):
        return False
    params = {ns.seq_id: ns.params for ns in plan.new_seqs}
    return not any(reads_outputs(params[s.seq_id] if s.seq_id in params else seqs[s.seq_id].params)
                   for s in plan.scheduled)


def reads_outputs(params) -> bool:
    """Whether sampling a sequence reads its output tokens' values (not only their count)."""
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or bool(params.bad_words_ids))

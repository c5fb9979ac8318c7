"""Engine core -> detokenizer -> parser -> API messages.

Every TextDelta says where its text starts in the choice's whole text (`offset`) and how
many tokens the choice has produced in all (`total_tokens`), so a resend after a
detokenizer or parser restart is idempotent: the API keeps only what it has not seen.
"""
from __future__ import annotations

import msgspec


class SeqInit(msgspec.Struct, array_like=True):
    seq_id: int
    request_id: str
    index: int
    prompt_tail: bytes  # the last prompt tokens, so the first output tokens decode in context
    stop: list[str]
    skip_special_tokens: bool


class TokenDelta(msgspec.Struct, array_like=True):
    seq_id: int
    token_ids: bytes
    finish_reason: str | None
    num_cached_tokens: int


class TokenBatch(msgspec.Struct, array_like=True, tag="tokens"):
    inits: list[SeqInit]  # new sequences (or, with resync, every live one, from scratch)
    deltas: list[TokenDelta]
    resync: bool = False


class StopHit(msgspec.Struct, array_like=True, tag="stop_hit"):
    """The detokenizer found a stop string: the engine frees the sequence at once."""
    seq_id: int


class TextDelta(msgspec.Struct, array_like=True):
    request_id: str
    index: int
    offset: int  # where `text` starts in this choice's text
    text: str
    total_tokens: int
    finish_reason: str | None
    num_cached_tokens: int


class TextBatch(msgspec.Struct, array_like=True, tag="text"):
    items: list[TextDelta]

"""Engine core -> detokenizer -> parser -> API messages.

Every TextDelta says where its text starts in the choice's whole text (`offset`) and how
many tokens the choice has produced in all (`total_tokens`), so a resend after a
detokenizer or parser restart is idempotent: the API keeps only what it has not seen.
"""
from __future__ import annotations

import msgspec


# Per token: (logprob, [(token id, logprob), ...] top alternatives)
Logprob = tuple[float, list[tuple[int, float]]]
# Per prompt token: the same and its rank (1 + how many tokens the model found more likely, ties included)
PromptLogprob = tuple[float, list[tuple[int, float]], int]


class ParseSpec(msgspec.Struct, array_like=True):
    """How the parser process splits one request's text (chosen by the API process)."""
    tool_parser: str = "passthrough"
    tools: list[dict] | None = None
    prefix: str = ""  # forced by tool_choice: already in the prompt, parsed as if generated
    reasoning: tuple[str, str] | None = None  # (start, end) markers
    in_reasoning: bool = False  # the prompt opened the reasoning block
    id_prefix: str = "call"
    single_call: bool = False  # a named tool_choice: the choice ends with its first call
    held: bool = False  # a grammar holds the reply to the calls' format: their arguments stream


class SeqInit(msgspec.Struct, array_like=True):
    seq_id: int
    request_id: str
    index: int
    prompt_tail: bytes  # the last prompt tokens, so the first output tokens decode in context
    stop: list[str]
    skip_special_tokens: bool
    parse: ParseSpec | None = None
    include_stop: bool = False


class TokenDelta(msgspec.Struct, array_like=True):
    seq_id: int
    token_ids: bytes
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list[Logprob] | None = None  # one per token in token_ids, when asked
    prompt_logprobs: list[PromptLogprob | None] | None = None
    queue_time: float = 0.0
    # With finish_reason "error" or "timeout": why, sent in order with the tokens (not beside them,
    # where a backlog of other frames could let the end of the text overtake it).
    error: str | None = None
    embedding: bytes = b""  # an embedding request's last delta: its vector, float32 bytes (StepResult)


class TokenBatch(msgspec.Struct, array_like=True, tag="tokens"):
    inits: list[SeqInit]  # new sequences (or, with resync, every live one, from scratch)
    deltas: list[TokenDelta]
    resync: bool = False


class StopHit(msgspec.Struct, array_like=True, tag="stop_hit"):
    """The detokenizer found a stop string: the engine frees the sequence at once."""
    seq_id: int


class ToolCallChunk(msgspec.Struct, array_like=True):
    index: int  # the call's index in the choice
    offset: int  # where `arguments` starts in the call's arguments string
    id: str | None
    name: str | None
    arguments: str


class TextDelta(msgspec.Struct, array_like=True):
    request_id: str
    index: int
    offset: int  # where `text` (content) starts in this choice's content
    text: str
    total_tokens: int
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list[Logprob] | None = None  # the choice's last len(logprobs) tokens up to total_tokens
    logprob_token_ids: bytes = b""  # the tokens those logprobs are of
    prompt_logprobs: list[PromptLogprob | None] | None = None
    queue_time: float = 0.0
    reasoning_offset: int = 0
    reasoning: str = ""
    tool_calls: list[ToolCallChunk] = []
    error: str | None = None  # as TokenDelta.error
    stop_str: str | None = None  # with finish_reason "stop": the stop string that ended it, if one did
    embedding: bytes = b""  # as TokenDelta.embedding


class ParseInit(msgspec.Struct, array_like=True):
    request_id: str
    index: int
    spec: ParseSpec


class TextBatch(msgspec.Struct, array_like=True, tag="text"):
    items: list[TextDelta]
    inits: list[ParseInit] = []  # for the parser process; it drops them before the API
    resync: bool = False

"""Per-request sampling parameters, validated once on the way in."""
from __future__ import annotations

import msgspec

from xinfer.errors import InvalidRequestError
from xinfer.structured import StructuredOutput


# Integers travel in int64 msgspec frames and torch tensors.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
SEED_MASK = INT64_MAX  # a sibling's seed (seed + i) stays within int64


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] = []  # never generated (tokenized into bad_words_ids by the caller)
    bad_words_ids: list[list[int]] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives per sampled token (0: just the chosen one)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (echo)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # a matched stop string stays at the end of the text
    structured: StructuredOutput | None = None  # the output follows this grammar (xinfer/structured.py)
    # /v1/embeddings: the prompt is run (prefill only, with max_tokens 0) for its pooled final hidden
    # state (--pooling), never for tokens; such a sequence takes no prefix-cache hits (cached blocks
    # hold no hidden states)
    embed: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        def bad(field, msg):
            raise InvalidRequestError(f"{field} {msg}", param=field.replace("token id", "logit_bias"))

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # Every integer travels in int64 msgspec frames and torch tensors: bound them here, at the edge.
        for name in ("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not INT64_MIN <= v <= INT64_MAX:
                bad(name, f"is out of range, got {v}")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be >= 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 0:
            bad("max_tokens", f"must be >= 0, got {self.max_tokens}")
        if self.embed and (self.n != 1 or self.max_tokens != 0 or self.prompt_logprobs is not None):
            bad("embed", "runs one choice with max_tokens 0 and no prompt_logprobs")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", f"must be between 0 and max_tokens, got {self.min_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad("top_k", f"must be -1, 0 (off) or >= 1, got {self.top_k}")
        if vocab_size is not None and self.top_k > vocab_size:
            self.top_k = 0  # keeping more tokens than the vocabulary has is no filter at all
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= 20:
                bad(name, f"must be in [0, 20], got {v}")
        if vocab_size is not None:
            for tid in (list(self.stop_token_ids) + list((self.logit_bias or {}).keys())
                        + list(self.allowed_token_ids or [])):
                if not 0 <= int(tid) < vocab_size:
                    bad("token id", f"{tid} is out of range for a vocabulary of {vocab_size}")
        for v in (self.logit_bias or {}).values():
            if not -100.0 <= v <= 100.0:
                bad("logit_bias", f"values must be in [-100, 100], got {v}")
        return self


def embedding_params() -> SamplingParams:
    """An embedding request's params: its prompt runs once, for the pooled vector (the one token
    the worker samples at the prompt's end is greedy and thrown away)."""
    return SamplingParams(max_tokens=0, temperature=0.0, embed=True)


def check_request(prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                  num_blocks: int | None = None, block_size: int = 16, clamp: bool = False) -> None:
    """The one check of a request before it reaches the engine core (the API process runs it, and
    the offline Engine): its sampling params, its token ids, and room for it in the context and
    in the KV cache. Raises InvalidRequestError naming the field. A structured output's spec is
    parsed apart (xinfer.structured.check), where a big one does not stall an event loop. `clamp`: a max_tokens over the
    room left after the prompt is lowered to it (the choice then ends with "length") instead."""
    params.validate(vocab_size)
    if not prompt_ids:
        raise InvalidRequestError("prompt is empty", param="prompt")
    bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"unknown token id {bad} (vocabulary size {vocab_size})", param="prompt")
    room = max_model_len - len(prompt_ids)
    if clamp and room >= 1 and params.max_tokens is not None and params.max_tokens > room:
        params.max_tokens = room  # params are shared by a request's prompts: the shortest room wins
        params.min_tokens = min(params.min_tokens, room)
    if room < 1 or params.max_tokens is not None and params.max_tokens > room:
        raise InvalidRequestError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                                  f"the model's context length ({max_model_len})", param="max_tokens",
                                  code="context_length_exceeded")
    need = -(-(len(prompt_ids) + (room if params.max_tokens is None else params.max_tokens)) // block_size)
    if num_blocks is not None and need > num_blocks:
        raise InvalidRequestError(f"request needs {need} KV blocks but the cache holds {num_blocks}; "
                                  "raise --kv-cache-gb or shorten it", param="max_tokens")


def tokenize_bad_words(tokenizer, params: SamplingParams) -> None:
    """bad_words as the token sequences the model could write them with: alone and after a space
    (as vLLM does); the worker bans each sequence's last token where the output ends with the rest."""
    if not params.bad_words or params.bad_words_ids:
        return
    if tokenizer is None:
        raise InvalidRequestError("bad_words needs a tokenizer; this model has none", param="bad_words")
    seqs = {tuple(tokenizer.encode(w, add_special_tokens=False)) for word in params.bad_words
            for w in (word, " " + word.lstrip())}
    params.bad_words_ids = [list(s) for s in seqs if s]

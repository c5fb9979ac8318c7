"""Incremental detokenization with stop strings.

Text is emitted only once it is stable: a token that ends in the middle of a multi-byte
character (decoded as U+FFFD) is held until the character completes, and the last
len(longest stop string) - 1 characters are held back until no stop string can start
there. The stop string itself is never emitted.
"""
from __future__ import annotations

# Decode from a few tokens before the new ones so tokenizers that strip a leading space
# or merge bytes across token boundaries give the same text as a full decode.
_CONTEXT = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool = True,
                 include_stop: bool = False):
        self.tok = tokenizer
        self.ids: list[int] = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.skip = skip_special_tokens
        self.text = ""  # all stable text so far (before any stop string)
        self.sent = 0  # characters of `text` already handed out
        self.stopped: str | None = None  # the stop string that matched
        self.include_stop = include_stop

    def _decode(self, ids):
        if self.tok is None:  # a model served by token ids only: no text
            return ""
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the newly stable text (may be empty)."""
        if self.stopped is not None:
            return ""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd"):
            return self._emit(final=False)  # an incomplete character: wait for more bytes
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._emit(final=False)

    def _emit(self, final: bool) -> str:
        if self.stop:
            start = max(0, self.sent - self.hold)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                i, s = min(hits)
                self.text = self.text[:i + len(s) if self.include_stop else i]
                self.stopped = s
                final = True
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent:end]
        self.sent = end
        return out

    def flush(self) -> str:
        """At the end of generation: release whatever was held back."""
        return self._emit(final=True)

"""Mistral [TOOL_CALLS] tool calls, both tokenizer generations."""
from __future__ import annotations

import hashlib
import json
import re

from xinfer.parsers.base import ToolParser, calls_from, register, skip_ws

_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@register
class MistralToolParser(ToolParser):
    """[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] (v3 tokenizers) and
    [TOOL_CALLS]name[ARGS]{...} (v11+, repeated per call; [CALL_ID]id may sit before [ARGS])."""
    name = "mistral"
    MARK = "[TOOL_CALLS]"
    starts = (MARK,)
    _NAME_END = re.compile(r"\s")
    _NAME_MAX = 256

    def _section(self, buf, off, final):
        i = skip_ws(buf, off + len(self.MARK))
        if i == len(buf):
            return (len(buf), None) if final else None
        if buf[i] in "[{":
            done = self._json_at(buf, i, final)
            if done is None:
                return None
            end, value = done
            return end, calls_from(value)
        # a name (and call id) is short and holds no whitespace: anything else is prose
        limit = i + self._NAME_MAX
        j = buf.find("[ARGS]", i, limit + len("[ARGS]"))
        bad = self._NAME_END.search(buf, i, j if j >= 0 else min(len(buf), limit))
        if bad:
            return bad.start(), None
        if j < 0:
            if len(buf) >= limit + len("[ARGS]"):
                return limit, None
            return (len(buf), None) if final else None
        name = buf[i:j].split("[CALL_ID]")[0]
        k = skip_ws(buf, j + len("[ARGS]"))
        if k == len(buf):
            return (len(buf), None) if final else None
        if buf[k] != "{" or not name:
            return k, None
        done = self._json_at(buf, k, final)
        if done is None:
            return None
        end, value = done
        return end, ([(name, value)] if isinstance(value, dict) else None)

    def _make_id(self, index):
        # Mistral templates reject ids that are not exactly 9 alphanumeric characters
        digest = int.from_bytes(hashlib.sha256(f"{self.id_prefix}-{index}".encode()).digest()[:8], "big")
        chars = []
        for _ in range(9):
            digest, r = divmod(digest, 62)
            chars.append(_ALPHABET[r])
        return "".join(chars)

    @classmethod
    def forced_prefix(cls, function_name):
        if function_name is None:
            return cls.MARK
        # the JSON-list form: both tokenizer generations parse it
        return cls.MARK + '[{"name": ' + json.dumps(function_name, ensure_ascii=False) + ', "arguments": '

    SECTION = (MARK + "[", ", ", "]")

    @classmethod
    def call_tag(cls, function_name):
        return '{"name": ' + json.dumps(function_name, ensure_ascii=False) + ', "arguments": ', "}"

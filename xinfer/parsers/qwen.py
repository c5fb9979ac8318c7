"""Hermes-style tool calls (Qwen2.5, Qwen3)."""
from __future__ import annotations

import json

from xinfer.parsers.base import TaggedCalls, call_from, register, skip_ws, too_deep


@register
class QwenToolParser(TaggedCalls):
    """Hermes style (Qwen2.5, Qwen3): <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>."""
    name = "qwen"
    START, END = "<tool_call>", "</tool_call>"

    def _parse(self, body: str):
        if too_deep(body):
            return None
        calls, i, dec = [], skip_ws(body, 0), json.JSONDecoder()
        while i < len(body):  # usually one object; tolerate several in one block
            try:
                value, i = dec.raw_decode(body, i)
            except ValueError:
                return None
            call = call_from(value)
            if call is None:
                return None
            calls.append(call)
            i = skip_ws(body, i)
        return calls or None

    @classmethod
    def forced_prefix(cls, function_name):
        if function_name is None:
            return "<tool_call>\n"
        return '<tool_call>\n{"name": ' + json.dumps(function_name, ensure_ascii=False) + ', "arguments": '

    @classmethod
    def call_tag(cls, function_name):
        return cls.forced_prefix(function_name), "}\n" + cls.END

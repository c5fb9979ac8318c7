"""Kimi K2 tool calls: JSON arguments after special-token headers."""
from __future__ import annotations

import re

from xinfer.parsers.base import MarkedCalls, load_json, register

# the call id is "functions.NAME:INDEX"; some outputs drop the "functions." part
_CALL_ID = re.compile(r"\s*(?:functions\.)?([^\s:<>]+?)(?::\d+)?\s*")


@register
class KimiK2ToolParser(MarkedCalls):
    """Kimi K2: <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
    <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>."""
    name = "kimik2"
    SECTIONS = {"<|tool_calls_section_begin|>": "<|tool_calls_section_end|>",
                "<|tool_call_section_begin|>": "<|tool_call_section_end|>"}  # both spellings occur
    CALL_BEGIN, CALL_END, ARGS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"

    def _call(self, inner: str):
        head, sep, tail = inner.partition(self.ARGS)
        m = _CALL_ID.fullmatch(head)
        if not sep or not m:
            return None
        try:
            args = load_json(tail) if tail.strip() else {}
        except ValueError:
            return None
        return (m.group(1), args) if isinstance(args, dict) else None

    @classmethod
    def forced_prefix(cls, function_name):
        head = "<|tool_calls_section_begin|>" + cls.CALL_BEGIN
        if function_name is None:
            return head
        if not _CALL_ID.fullmatch(function_name) or ":" in function_name:
            return None
        return head + f"functions.{function_name}:0" + cls.ARGS

    SECTION = ("<|tool_calls_section_begin|>", "", "<|tool_calls_section_end|>")

    @classmethod
    def call_tag(cls, function_name):
        prefix = cls.forced_prefix(function_name)
        return None if prefix is None else (prefix[len(cls.SECTION[0]):], cls.CALL_END)

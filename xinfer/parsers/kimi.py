"""Kimi K2 tool calls: JSON arguments after special-token headers."""
from __future__ import annotations

import re

from xinfer.parsers.base import ToolParser, load_json, register

# the call id is "functions.NAME:INDEX"; some outputs drop the "functions." part
_CALL_ID = re.compile(r"\s*(?:functions\.)?([^\s:<>]+?)(?::\d+)?\s*")


@register
class KimiK2ToolParser(ToolParser):
    """Kimi K2: <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
    <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>."""
    name = "kimik2"
    SECTIONS = {"<|tool_calls_section_begin|>": "<|tool_calls_section_end|>",
                "<|tool_call_section_begin|>": "<|tool_call_section_end|>"}  # both spellings occur
    CALL_BEGIN, CALL_END, ARGS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
    starts = tuple(SECTIONS)

    def _section(self, buf, off, final):
        begin = next(b for b in self.SECTIONS if buf.startswith(b, off))
        done = self._until(buf, off + len(begin), self.SECTIONS[begin], final)
        if done is None:
            return None
        n, body = done
        if body is None:
            body = buf[off + len(begin):]
            if not body.rstrip().endswith(self.CALL_END):
                return n, None
        return n, self._parse(body)

    def _parse(self, body: str):
        calls, rest = [], body.strip()
        while rest:
            if not rest.startswith(self.CALL_BEGIN):
                return None
            e = rest.find(self.CALL_END)
            if e < 0:
                return None
            head, sep, tail = rest[len(self.CALL_BEGIN):e].partition(self.ARGS)
            m = _CALL_ID.fullmatch(head)
            if not sep or not m:
                return None
            try:
                args = load_json(tail) if tail.strip() else {}
            except ValueError:
                return None
            if not isinstance(args, dict):
                return None
            calls.append((m.group(1), args))
            rest = rest[e + len(self.CALL_END):].strip()
        return calls or None

    @classmethod
    def forced_prefix(cls, function_name):
        head = "<|tool_calls_section_begin|>" + cls.CALL_BEGIN
        if function_name is None:
            return head
        if not _CALL_ID.fullmatch(function_name) or ":" in function_name:
            return None
        return head + f"functions.{function_name}:0" + cls.ARGS

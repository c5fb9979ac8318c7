"""MiniMax-M2 tool calls: XML invocations inside <minimax:tool_call> ... </minimax:tool_call>."""
from __future__ import annotations

import re

from xinfer.parsers.base import TaggedCalls, register
from xinfer.parsers.qwen_coder import _convert

_NAME = r"""\s*("[^"<>]*"|'[^'<>]*'|[^\s"'<>]+)\s*"""
_INVOKE = re.compile(r"\s*<invoke name=" + _NAME + r">(.*?)</invoke>\s*", re.DOTALL)
_PARAM = re.compile(r"\s*<parameter name=" + _NAME + r">(.*?)</parameter>\s*", re.DOTALL)


def _unquote(name: str) -> str:
    return name[1:-1] if name[:1] in "\"'" and len(name) > 1 and name[-1] == name[0] else name


@register
class MiniMaxM2ToolParser(TaggedCalls):
    """MiniMax-M2: <minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="K">V</parameter>
    \\n...</invoke>...\\n</minimax:tool_call>; values are text, typed by the tool's schema."""
    name = "minimax_m2"
    START, END = "<minimax:tool_call>", "</minimax:tool_call>"

    def _parse(self, body: str):
        calls, i = [], 0
        while i < len(body):
            m = _INVOKE.match(body, i)
            if not m:
                if body[i:].strip():
                    return None
                break
            name = _unquote(m.group(1)).strip()
            props = (self.schemas.get(name) or {}).get("properties") or {}
            args, params, j = {}, m.group(2), 0
            while j < len(params):
                p = _PARAM.match(params, j)
                if not p:
                    if params[j:].strip():
                        return None
                    break
                key, value = _unquote(p.group(1)).strip(), p.group(2)
                value = value.removeprefix("\n").removesuffix("\n")
                args[key] = _convert(value, props.get(key))
                j = p.end()
            if not name:
                return None
            calls.append((name, args))
            i = m.end()
        return calls or None

    @classmethod
    def forced_prefix(cls, function_name):
        if function_name is None:
            return cls.START + "\n"
        if '"' in function_name or "<" in function_name or ">" in function_name:
            return None
        return cls.START + f'\n<invoke name="{function_name}">\n'

    ARGS_STYLE = "minimax_xml"
    SECTION = (START + "\n", "\n", "\n" + END)

    @classmethod
    def call_tag(cls, function_name):
        if cls.forced_prefix(function_name) is None:
            return None
        return f'<invoke name="{function_name}">\n', "\n</invoke>"

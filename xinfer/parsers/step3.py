"""Step3 tool calls: StepTML invocations inside <｜tool_calls_begin｜> ... <｜tool_calls_end｜>."""
from __future__ import annotations

import re

from xinfer.parsers.base import MarkedCalls, register
from xinfer.parsers.qwen_coder import _convert

_INVOKE = re.compile(r'\s*<steptml:invoke name="([^"<>]+)">(.*)</steptml:invoke>\s*', re.DOTALL)
_PARAM = re.compile(r'\s*<steptml:parameter name="([^"<>]+)">(.*?)</steptml:parameter>\s*', re.DOTALL)


@register
class Step3ToolParser(MarkedCalls):
    """Step3: <｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜>
    <steptml:invoke name="NAME"><steptml:parameter name="K">V</steptml:parameter>...
    </steptml:invoke><｜tool_call_end｜>...<｜tool_calls_end｜>; values are text, typed by the
    tool's schema."""
    name = "step3"
    CALLS_BEGIN, CALLS_END = "<｜tool_calls_begin｜>", "<｜tool_calls_end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool_call_begin｜>", "<｜tool_call_end｜>", "<｜tool_sep｜>"
    SECTIONS = {CALLS_BEGIN: CALLS_END}

    def _call(self, inner: str):
        kind, sep, invoke = inner.partition(self.SEP)
        m = _INVOKE.fullmatch(invoke)
        if not sep or kind.strip() != "function" or not m:
            return None
        return self._invoke(m.group(1).strip(), m.group(2))

    def _invoke(self, name: str, params: str):
        props = (self.schemas.get(name) or {}).get("properties") or {}
        args, i = {}, 0
        while i < len(params):
            p = _PARAM.match(params, i)
            if not p:
                return None if params[i:].strip() else (name, args)
            key = p.group(1).strip()
            args[key] = _convert(p.group(2).strip(), props.get(key))
            i = p.end()
        return name, args

    @classmethod
    def forced_prefix(cls, function_name):
        head = cls.CALLS_BEGIN + cls.CALL_BEGIN + "function" + cls.SEP
        if function_name is None:
            return head
        if '"' in function_name or "<" in function_name or ">" in function_name:
            return None
        return head + f'<steptml:invoke name="{function_name}">'

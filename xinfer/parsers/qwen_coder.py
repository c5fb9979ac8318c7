"""Qwen3-Coder XML-style tool calls."""
from __future__ import annotations

import ast
import json
import re

from xinfer.parsers.base import load_json, register
from xinfer.parsers.qwen import QwenToolParser

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


def _convert(value: str, schema) -> object:
    """A Qwen3-Coder parameter value (always text) as the type the tool schema asks for."""
    t = schema.get("type") if isinstance(schema, dict) else None
    types = t if isinstance(t, list) else [t] if t else []
    if not types or "string" in types:
        return value
    text = value.strip()
    for t in types:
        try:
            if t == "integer":
                return int(text)
            if t == "number":
                v = json.loads(text)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    return v
            elif t == "boolean" and text.lower() in ("true", "false"):
                return text.lower() == "true"
            elif t == "null" and text.lower() in ("null", "none"):
                return None
            elif t in ("object", "array"):
                try:
                    v = load_json(text)
                except ValueError:
                    v = ast.literal_eval(text)  # models sometimes write Python literals here
                if isinstance(v, dict if t == "object" else list):
                    return v
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
    return value


@register
class QwenCoderToolParser(QwenToolParser):
    """Qwen3-Coder: <tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n
    </function>\\n</tool_call>; values are text, typed by the tool's schema."""
    name = "qwen_coder"

    def _parse(self, body: str):
        if "<function=" not in body:  # the model fell back to Hermes JSON
            return super()._parse(body)
        calls, leftover = [], body
        for m in _FUNCTION.finditer(body):
            leftover = leftover.replace(m.group(0), "", 1)
            name = m.group(1).strip()
            props = (self.schemas.get(name) or {}).get("properties") or {}
            args = {}
            for p in _PARAMETER.finditer(m.group(2)):
                key, value = p.group(1).strip(), p.group(2)
                # the template writes "<parameter=P>\nVALUE\n</parameter>": those two newlines go
                value = value.removeprefix("\n")
                value = value.removesuffix("\n")
                args[key] = _convert(value, props.get(key))
            calls.append((name, args))
        if not calls or leftover.strip():
            return None
        return calls

    @classmethod
    def forced_prefix(cls, function_name):
        if function_name is None:
            return "<tool_call>\n"
        return f"<tool_call>\n<function={function_name}>\n"

    ARGS_STYLE = "qwen_xml"

    @classmethod
    def call_tag(cls, function_name):
        if "<" in function_name or ">" in function_name or "\n" in function_name:
            return None
        return cls.forced_prefix(function_name), "\n</function>\n" + cls.END

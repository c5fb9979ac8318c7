"""GLM-4.5 / 4.6 and GLM-4.7 MoE tool calls: <tool_call> with <arg_key>/<arg_value> pairs."""
from __future__ import annotations

import json
import re

from xinfer.parsers.base import load_json, register
from xinfer.parsers.qwen import QwenToolParser
from xinfer.parsers.qwen_coder import _convert

_NAME = re.compile(r"\s*([\w.:\-]+)\s*")  # a function name: brackets or quotes mean it is no call
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)


def _value(text: str, schema) -> object:
    """The template writes strings as they are and everything else as JSON: the tool's schema
    decides; without one, text that loads as JSON is taken as JSON."""
    if isinstance(schema, dict) and schema.get("type"):
        return _convert(text, schema)
    try:
        value = load_json(text)
        json.dumps(value, allow_nan=False)  # NaN / Infinity load but are no JSON to send on
    except ValueError:
        return text
    return value


@register
class Glm45ToolParser(QwenToolParser):
    """GLM-4.5 / 4.6: <tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...
    </tool_call>, one call per block; values are text for strings, JSON otherwise."""
    name = "glm45_moe"

    def _parse(self, body: str):
        if body.lstrip().startswith("{"):  # the model fell back to Hermes JSON
            return super()._parse(body)
        m = _NAME.match(body)
        if not m:
            return None
        name, i, args = m.group(1), m.end(), {}
        props = (self.schemas.get(name) or {}).get("properties") or {}
        while i < len(body):
            p = _PAIR.match(body, i)
            if not p:
                return None
            key = p.group(1).strip()
            if not key:
                return None
            args[key] = _value(p.group(2), props.get(key))
            i = p.end()
        return [(name, args)]

    AFTER_NAME = "\n"  # what the template writes between the name and the first key

    @classmethod
    def forced_prefix(cls, function_name):
        if function_name is None:
            return "<tool_call>"
        if not _NAME.fullmatch(function_name):
            return None
        return f"<tool_call>{function_name}{cls.AFTER_NAME}"

    ARGS_STYLE = "glm_xml"

    @classmethod
    def call_tag(cls, function_name):
        prefix = cls.forced_prefix(function_name)
        return None if prefix is None else (prefix, cls.END)


@register
class Glm47ToolParser(Glm45ToolParser):
    """GLM-4.7: as GLM-4.5 without the newlines: <tool_call>NAME<arg_key>K</arg_key>
    <arg_value>V</arg_value>...</tool_call>."""
    name = "glm47_moe"
    AFTER_NAME = ""

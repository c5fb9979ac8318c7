"""Bare JSON tool calls: the whole reply is a call object or a list of them."""
from __future__ import annotations

import json

from xinfer.parsers.base import ToolParser, calls_from, register


@register
class JsonToolParser(ToolParser):
    """The whole reply is a call object {"name", "arguments"|"parameters"} or a list of them."""
    name = "json"
    leading = "{["
    args_key = "arguments"  # what a forced call names its arguments

    def _section(self, buf, off, final):
        done = self._json_at(buf, off, final)
        if done is None:
            return None
        end, value = done
        return end, calls_from(value)

    @classmethod
    def forced_prefix(cls, function_name):
        if function_name is None:
            return '{"name": '
        return '{"name": ' + json.dumps(function_name, ensure_ascii=False) + f', "{cls.args_key}": '

    @classmethod
    def call_tag(cls, function_name):
        return cls.forced_prefix(function_name), "}"

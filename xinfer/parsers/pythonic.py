"""Pythonic tool calls (Llama 3.2 / Llama 4): a Python list of calls with literal arguments."""
from __future__ import annotations

import ast
import json

from xinfer.parsers.base import Balance, ToolParser, register


def _dotted(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


@register
class PythonicToolParser(ToolParser):
    """Llama 3.2 / Llama 4 pythonic: [get_weather(city="SF", days=3), other()], literals only."""
    name = "pythonic"
    leading = "["

    def _section(self, buf, off, final):
        if self._sec is None:
            self._sec = Balance(off, quotes="\"'")
        end = self._sec.scan(buf)
        if end < 0:
            return (len(buf), None) if final else None
        return end, self._parse(buf[off:end])

    @staticmethod
    def _parse(text: str):
        try:
            tree = ast.parse(text.strip(), mode="eval").body
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args:
                return None
            name = _dotted(node.func)
            if name is None or any(kw.arg is None for kw in node.keywords):
                return None
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
                json.dumps(args)  # literals that JSON cannot hold (sets, bytes, complex) fail here
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return None
            calls.append((name, args))
        return calls

    @classmethod
    def forced_prefix(cls, function_name):
        if function_name is None:
            return "["
        if not all(part.isidentifier() for part in function_name.split(".")):
            return None
        return f"[{function_name}("

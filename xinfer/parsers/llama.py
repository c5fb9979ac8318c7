"""Llama 3.1/3.2 JSON tool calls."""
from __future__ import annotations

from xinfer.parsers.base import WS, call_from, register, skip_ws
from xinfer.parsers.json_calls import JsonToolParser


@register
class LlamaToolParser(JsonToolParser):
    """Llama 3.1/3.2 JSON tool calling: [<|python_tag|>]{"name": ..., "parameters": {...}},
    several separated by ";"."""
    name = "llama"
    TAG = "<|python_tag|>"
    starts = (TAG,)
    leading = "{"
    gap = WS + ";"
    args_key = "parameters"
    SECTION = ("", "; ", "")

    def _section(self, buf, off, final):
        i = off
        if buf.startswith(self.TAG, off):
            i = skip_ws(buf, off + len(self.TAG))
            if i == len(buf):
                return (len(buf), None) if final else None
            if buf[i] != "{":  # python code for a built-in tool, not JSON: content
                return off + len(self.TAG), None
        done = self._json_at(buf, i, final)
        if done is None:
            return None
        end, value = done
        call = call_from(value)
        return end, ([call] if call else None)

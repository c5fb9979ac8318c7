"""No tool calls: the text is all content."""
from __future__ import annotations

from xinfer.parsers.base import ToolParser, register


@register
class PassthroughToolParser(ToolParser):
    name = "passthrough"

    def _section(self, buf, off, final):  # no markers open a section here: never asked
        return len(buf) - off, None

    def _run(self, final):
        calls, self._early = self._early, []
        return self._take(len(self._buf)), calls

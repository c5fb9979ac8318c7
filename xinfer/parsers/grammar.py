"""Grammars that hold a reply to a tool-call family's format: xgrammar structural tags built
from a parser's call_tag / SECTION / ARGS_STYLE and the tools' JSON schemas, so a forced call's
arguments are valid against its schema, token by token, as they stream."""
from __future__ import annotations

import os

from xinfer.ipc.text import ToolCallChunk
from xinfer.parsers.base import Balance, ToolParser


def _schema(fn: dict):
    params = fn.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def tool_tag(parser: type[ToolParser], tools: list[dict], choice: str, parallel: bool = True) -> dict | None:
    """The structural tag for `choice`: "required" (one call or more of any tool), a function's
    name (exactly one call of it) or "auto" (free text; a call, once it opens, follows its schema).
    parallel=False allows one call. None: the family has no grammar (it keeps the forced prefix)."""
    tags = []
    for tool in tools:
        fn = tool.get("function", tool)
        if choice not in ("auto", "required") and fn.get("name") != choice:
            continue
        tag = parser.call_tag(fn["name"])
        if tag is None:
            return None
        tags.append({"type": "tag", "begin": tag[0], "end": tag[1],
                     "content": {"type": "json_schema", "json_schema": _schema(fn), "style": parser.ARGS_STYLE}})
    if not tags:
        return None
    one = not parallel or choice not in ("auto", "required")
    open_, sep, close = parser.SECTION
    calls = {"type": "tags_with_separator", "tags": tags, "separator": sep, "at_least_one": True,
             "stop_after_first": one}
    if choice == "auto":
        if open_:
            fmt = {"type": "triggered_tags", "triggers": [open_], "stop_after_first": one,
                   "tags": [{"type": "tag", "begin": open_, "content": calls, "end": close}]}
        else:
            trigger = os.path.commonprefix([t["begin"] for t in tags])
            if not trigger.strip():
                return None  # nothing marks a call's start: a grammar would hold every reply
            fmt = {"type": "triggered_tags", "triggers": [trigger], "tags": tags, "stop_after_first": one}
    elif open_:
        fmt = {"type": "sequence", "elements": [{"type": "const_string", "value": open_}, calls,
                                                {"type": "const_string", "value": close}]}
    else:
        fmt = calls
    return {"type": "structural_tag", "format": fmt}


class HeldCalls:
    """The parser of a reply a forced-call grammar holds (tool_tag, a JSON-argument family): its
    text is exactly SECTION open, calls BEGIN(name) ARGS END(name) SECTION[1] apart, SECTION
    close, so each call's arguments stream as they are generated instead of arriving whole."""

    def __init__(self, family: ToolParser, names: list[str]):
        self.family = family
        self.begins = [(tag[0], tag[1], n) for n in names if (tag := family.call_tag(n)) is not None]
        self.open, self.sep, self.close = family.SECTION
        self.buf, self.pos, self.count = "", 0, 0
        self.phase = "open" if self.open else "between"
        self.bal: Balance | None = None
        self.end = ""

    def feed(self, text: str) -> tuple[str, list[ToolCallChunk]]:
        self.buf += text
        return self._run(False)

    def finish(self) -> tuple[str, list[ToolCallChunk]]:
        return self._run(True)

    def _run(self, final: bool) -> tuple[str, list[ToolCallChunk]]:
        calls: list[ToolCallChunk] = []
        while True:
            rest = self.buf[self.pos:]
            if self.phase == "args":
                end = self.bal.scan(self.buf)
                stop = len(self.buf) if end < 0 else end
                if stop > self.pos:
                    self._args(calls, self.buf[self.pos:stop])
                    self.pos = stop
                if end < 0:
                    break
                self.phase = "end"
                continue
            if self.phase == "done":
                break
            options = {"open": [(self.open, None)], "end": [(self.end, None)]}.get(self.phase) or (
                [(self.sep + b, (e, n)) for b, e, n in self.begins] + [(self.close, "close")] if self.count
                else [(b, (e, n)) for b, e, n in self.begins])
            hit = next(((lit, what) for lit, what in options if lit and rest.startswith(lit)), None)
            if hit is None:
                if not final and any(lit.startswith(rest) and lit != rest for lit, _ in options):
                    break  # the marker is still arriving
                # an empty close ends the calls; else not the held format (it should not happen)
                hit = ("", "close") if ("", "close") in options else None
                if hit is None:
                    self.phase = "done"
                    break
            lit, what = hit
            self.pos += len(lit)
            if self.phase == "open" or self.phase == "end":
                self.phase, self.count = "between", self.count + (self.phase == "end")
            elif what == "close":
                self.phase = "done"
            else:
                self.end, name = what
                calls.append(ToolCallChunk(self.count, 0, self.family._make_id(self.count), name, ""))
                self.bal, self.phase = Balance(self.pos), "args"
        content = ""
        if self.phase == "done" and self.pos < len(self.buf):
            content, self.pos = self.buf[self.pos:], len(self.buf)
        return content, calls

    def _args(self, calls: list[ToolCallChunk], text: str) -> None:
        if calls and calls[-1].index == self.count:
            calls[-1].arguments += text
        else:
            calls.append(ToolCallChunk(self.count, 0, None, None, text))

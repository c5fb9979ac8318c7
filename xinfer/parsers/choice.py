"""One choice's parsing in the parser process: reasoning first, then tool calls in the content,
with every output tagged by its offset in its own stream (see xinfer/workers/parser.py)."""
from __future__ import annotations

import logging

from xinfer.ipc.text import ParseSpec, TextBatch, ToolCallChunk
from xinfer.parsers.base import get_tool_parser
from xinfer.parsers.grammar import HeldCalls
from xinfer.parsers.reasoning import ReasoningParser

# the parser process's logger, as before this code moved out of it
log = logging.getLogger("xinfer.parser")


class ChoiceParser:
    """Reasoning first, then tool calls in what is left (the content)."""

    def __init__(self, spec: ParseSpec):
        self.reasoning = ReasoningParser(*spec.reasoning, in_reasoning=spec.in_reasoning) if spec.reasoning else None
        self.tools = None
        if spec.tool_parser != "passthrough":
            self.tools = get_tool_parser(spec.tool_parser)(spec.tools, spec.id_prefix, prefix=spec.prefix)
            if spec.held:
                self.tools = HeldCalls(self.tools, list(self.tools.schemas))
        self.content_sent = self.reasoning_sent = 0
        self.args_sent: dict[int, int] = {}
        self.single_call, self.called = spec.single_call, False

    def feed(self, text: str, final: bool) -> tuple[int, str, int, str, list[ToolCallChunk]]:
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        if final and self.reasoning:
            r, c = self.reasoning.finish()
            reasoning, content = reasoning + r, content + c
        calls: list[ToolCallChunk] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if final:
                c, more = self.tools.finish()
                content, calls = content + c, calls + more
        if self.single_call and (self.called or calls):  # nothing after the one call asked for
            content, calls, self.called = "", [c for c in calls if c.index == 0], True
        for c in calls:
            # kept here like content_sent, so a parser may also send a call's arguments in pieces
            c.offset = self.args_sent.get(c.index, 0)
            self.args_sent[c.index] = c.offset + len(c.arguments)
        out = (self.content_sent, content, self.reasoning_sent, reasoning, calls)
        self.content_sent += len(content)
        self.reasoning_sent += len(reasoning)
        return out


def parse_batch(batch: TextBatch, states: dict) -> TextBatch:
    """Apply one batch to the per-choice parser states; the result goes to the API."""
    if batch.resync:
        states.clear()
    for init in batch.inits:
        try:
            states[(init.request_id, init.index)] = ChoiceParser(init.spec)
        except Exception as e:  # a spec the API should not have sent: the text goes through as it is
            log.warning("no parser for %s: %s", init.request_id, e)
    items = []
    for d in batch.items:
        key = (d.request_id, d.index)
        p = states.get(key)
        if p is not None:
            final = d.finish_reason is not None
            try:
                d.offset, d.text, d.reasoning_offset, d.reasoning, d.tool_calls = p.feed(d.text, final)
            except Exception as e:  # a parser bug must not end the process (or loop on every resync)
                log.warning("parser failed on %s (%s: %s); its text goes on as plain content", d.request_id,
                            type(e).__name__, e)
                states[key] = p = _plain_after(p)
                d.offset, d.text, d.reasoning_offset, d.reasoning, d.tool_calls = p.feed(d.text, final)
            if final:
                del states[key]
        items.append(d)
    return TextBatch(items)


def _plain_after(failed: ChoiceParser) -> ChoiceParser:
    """A pass-through parser that continues the failed one's offsets."""
    p = ChoiceParser(ParseSpec())
    p.content_sent, p.reasoning_sent = failed.content_sent, failed.reasoning_sent
    return p

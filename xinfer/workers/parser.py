"""The parser process: sits between the detokenizer and the API and splits each choice's
text into reasoning, content and tool calls (xinfer/parsers/).

Every output carries its offset in its own stream (content, reasoning, each call's
arguments), so after a restart the resent, re-parsed text is trimmed by the API exactly
like plain text.
"""
from __future__ import annotations

import logging
import os

import zmq

from xinfer.ipc import launch
from xinfer.ipc.channels import Codec, socket
from xinfer.ipc.text import ParseSpec, TextBatch, ToolCallChunk

log = logging.getLogger("xinfer.parser")


class ChoiceParser:
    """Reasoning first, then tool calls in what is left (the content)."""

    def __init__(self, spec: ParseSpec):
        from xinfer.parsers import ReasoningParser, get_tool_parser

        self.reasoning = ReasoningParser(*spec.reasoning, in_reasoning=spec.in_reasoning) if spec.reasoning else None
        self.tools = None
        if spec.tool_parser != "passthrough":
            self.tools = get_tool_parser(spec.tool_parser)(spec.tools, spec.id_prefix, prefix=spec.prefix)
        self.content_sent = self.reasoning_sent = 0
        self.args_sent: dict[int, int] = {}
        self.single_call, self.called = spec.single_call, False

    def feed(self, text: str, final: bool) -> tuple[int, str, int, str, list[ToolCallChunk]]:
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        if final and self.reasoning:
            r, c = self.reasoning.finish()
            reasoning, content = reasoning + r, content + c
        calls = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if final:
                c, more = self.tools.finish()
                content, calls = content + c, calls + more
        if self.single_call and (self.called or calls):  # nothing after the one call asked for
            content, calls, self.called = "", calls[:1] if not self.called else [], True
        chunks = []
        for c in calls:
            off = self.args_sent.get(c.index, 0)
            self.args_sent[c.index] = off + len(c.arguments)
            chunks.append(ToolCallChunk(c.index, off, c.id, c.name, c.arguments))
        out = (self.content_sent, content, self.reasoning_sent, reasoning, chunks)
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
            d.offset, d.text, d.reasoning_offset, d.reasoning, d.tool_calls = p.feed(d.text, d.finish_reason
                                                                                   is not None)
            if d.finish_reason:
                del states[key]
        items.append(d)
    return TextBatch(items)


def run_parser(in_addr: str, out_addr: str, log_level: str, parent: int) -> None:
    from xinfer.cli import set_title, setup_logging

    setup_logging(log_level, "xinfer::parser")
    set_title("xinfer::parser")
    ctx = zmq.Context()
    pull = socket(ctx, zmq.PULL, in_addr, bind=True)  # the detokenizer connects here
    push = socket(ctx, zmq.PUSH, out_addr, bind=False)
    codec = Codec(TextBatch)
    states: dict[tuple[str, int], ChoiceParser] = {}
    launch.started("xinfer::parser")
    while True:
        if not pull.poll(1000):
            if os.getppid() != parent:
                return
            continue
        batch = codec.decode(pull.recv())
        if batch is None:
            continue
        out = parse_batch(batch, states)
        if out.items:
            push.send(codec.encode(out))

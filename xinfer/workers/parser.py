"""The parser process: sits between the detokenizer and the API and splits each choice's
text into reasoning, content and tool calls (xinfer/parsers/).

Every output carries its offset in its own stream (content, reasoning, each call's
arguments), so after a restart the resent, re-parsed text is trimmed by the API exactly
like plain text.
"""
from __future__ import annotations

import logging

import zmq

from xinfer import process
from xinfer.ipc.channels import Codec, socket
from xinfer.ipc.text import TextBatch
from xinfer.ipc.topology import Topology
from xinfer.parsers.choice import ChoiceParser, parse_batch

log = logging.getLogger("xinfer.parser")


def run_parser(topology: Topology, gen: int, log_level: str, parent: int) -> None:
    process.run_process("xinfer::parser", log_level, _main, topology, gen, parent, parent=parent)


def _main(topology: Topology, gen: int, parent: int) -> None:
    ctx = zmq.Context()
    pull = socket(ctx, zmq.PULL, topology.to_parser(gen), bind=True)  # the detokenizer connects here
    push = socket(ctx, zmq.PUSH, topology.from_engine, bind=False)
    codec = Codec(TextBatch)
    states: dict[tuple[str, int], ChoiceParser] = {}

    def handle(batch: TextBatch) -> None:
        out = parse_batch(batch, states)
        if out.items:
            push.send(codec.encode(out))

    process.started("xinfer::parser")
    process.frame_loop(pull, codec, handle, parent)

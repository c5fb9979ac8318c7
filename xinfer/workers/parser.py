"""The parser process: sits between the detokenizer and the API, where tool-call and
reasoning parsers run. Today it passes text through unchanged."""
from __future__ import annotations

import os

import zmq

from xinfer.ipc import launch
from xinfer.ipc.channels import Codec, socket
from xinfer.ipc.text import TextBatch


def run_parser(in_addr: str, out_addr: str, log_level: str, parent: int) -> None:
    from xinfer.cli import set_title, setup_logging

    setup_logging(log_level, "xinfer::parser")
    set_title("xinfer::parser")
    ctx = zmq.Context()
    pull = socket(ctx, zmq.PULL, in_addr, bind=True)  # the detokenizer connects here
    push = socket(ctx, zmq.PUSH, out_addr, bind=False)
    codec = Codec(TextBatch)
    launch.started("xinfer::parser")
    while True:
        if not pull.poll(1000):
            if os.getppid() != parent:
                return
            continue
        frame = pull.recv()
        if codec.decode(frame) is not None:  # only well-formed batches travel on
            push.send(frame)

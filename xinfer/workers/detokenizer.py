"""The detokenizer process: token ids in, stable text out, stop strings reported back."""
from __future__ import annotations

import logging
import os

import zmq

from xinfer.detokenizer import IncrementalDetokenizer
from xinfer.ipc import launch
from xinfer.ipc.channels import Codec, socket
from xinfer.ipc.step import unpack_ids
from xinfer.ipc.text import ParseInit, StopHit, TextBatch, TextDelta, TokenBatch

log = logging.getLogger("xinfer.detokenizer")


def run_detokenizer(model: str | None, load_format: str, in_addr: str, out_addr: str, stop_addr: str,
                    log_level: str, parent: int) -> None:
    from xinfer.cli import set_title, setup_logging
    from xinfer.loader import load_model_info

    setup_logging(log_level, "xinfer::detokenizer")
    set_title("xinfer::detokenizer")
    tok = load_model_info(model, load_format).tokenizer
    ctx = zmq.Context()
    pull = socket(ctx, zmq.PULL, in_addr, bind=False)
    push = socket(ctx, zmq.PUSH, out_addr, bind=False)
    stops = socket(ctx, zmq.PUSH, stop_addr, bind=False)
    rx, tx = Codec(TokenBatch), Codec(TextBatch | StopHit)
    seqs: dict[int, tuple] = {}  # seq id -> (request id, index, detokenizer, tokens so far)
    launch.started("xinfer::detokenizer")
    while True:
        if not pull.poll(1000):
            if os.getppid() != parent:
                return
            continue
        batch = rx.decode(pull.recv())
        if batch is None:
            continue
        parse_inits = []
        for init in batch.inits:
            det = IncrementalDetokenizer(tok, unpack_ids(init.prompt_tail), init.stop, init.skip_special_tokens)
            seqs[init.seq_id] = (init.request_id, init.index, det, [0])
            if init.parse is not None:
                parse_inits.append(ParseInit(init.request_id, init.index, init.parse))
        out = []
        for d in batch.deltas:
            entry = seqs.get(d.seq_id)
            if entry is None:
                continue  # stopped by a stop string, or sent before a resync: nothing to do
            rid, index, det, count = entry
            ids = unpack_ids(d.token_ids)
            count[0] += len(ids)
            offset = det.sent
            text = det.add(ids)
            reason = d.finish_reason
            if det.stopped is not None and reason is None:
                stops.send(tx.encode(StopHit(d.seq_id)))
                reason = "stop"
            if reason:
                text += det.flush()
                del seqs[d.seq_id]
            if text or reason or d.logprobs or d.prompt_logprobs:
                out.append(TextDelta(rid, index, offset, text, count[0], reason, d.num_cached_tokens, d.logprobs,
                                     d.token_ids if d.logprobs else b"", d.prompt_logprobs, d.queue_time))
        if out or parse_inits:
            push.send(tx.encode(TextBatch(out, parse_inits, batch.resync)))

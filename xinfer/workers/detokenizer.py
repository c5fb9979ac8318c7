"""The detokenizer process: token ids in, stable text out, stop strings reported back."""
from __future__ import annotations

import logging

import zmq

from xinfer import process
from xinfer.detokenizer import IncrementalDetokenizer
from xinfer.ipc.channels import Codec, socket
from xinfer.ipc.step import unpack_ids
from xinfer.ipc.text import ParseInit, StopHit, TextBatch, TextDelta, TokenBatch
from xinfer.ipc.topology import Topology
from xinfer.loader.tokenizer import Tokenizer

log = logging.getLogger("xinfer.detokenizer")


def run_detokenizer(tokenizer: tuple, topology: Topology, gen: int, log_level: str, parent: int) -> None:
    """`tokenizer`: Tokenizer.to_spec() of the engine core's (a restart needs no model re-read)."""
    process.run_process("xinfer::detokenizer", log_level, _main, tokenizer, topology, gen, parent, parent=parent)


def _main(tokenizer: tuple, topology: Topology, gen: int, parent: int) -> None:
    tok = Tokenizer.from_spec(tokenizer) if tokenizer is not None else None
    ctx = zmq.Context()
    pull = socket(ctx, zmq.PULL, topology.to_detokenizer(gen), bind=False)
    push = socket(ctx, zmq.PUSH, topology.to_parser(gen), bind=False)
    stops = socket(ctx, zmq.PUSH, topology.stop_hits, bind=False)
    rx, tx = Codec(TokenBatch), Codec(TextBatch | StopHit)
    seqs: dict[int, tuple] = {}  # seq id -> (request id, index, detokenizer, tokens so far)

    def handle(batch: TokenBatch) -> None:
        parse_inits = []
        for init in batch.inits:
            det = IncrementalDetokenizer(tok, unpack_ids(init.prompt_tail), init.stop, init.skip_special_tokens,
                                         init.include_stop)
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
            try:
                text = det.add(ids)
                reason = d.finish_reason
                if det.stopped is not None and reason is None:
                    stops.send(tx.encode(StopHit(d.seq_id)))
                    reason = "stop"
                if reason:
                    text += det.flush()
            except Exception as e:  # one sequence's bad tokens must not end the process for all
                log.warning("detokenizing %s failed: %s: %s; ending it", rid, type(e).__name__, e)
                stops.send(tx.encode(StopHit(d.seq_id)))  # frees it in the engine core
                text, reason = "", "error"
            if reason:
                del seqs[d.seq_id]
            if text or reason or d.logprobs or d.prompt_logprobs:
                out.append(TextDelta(rid, index, offset, text, count[0], reason, d.num_cached_tokens, d.logprobs,
                                     d.token_ids if d.logprobs else b"", d.prompt_logprobs, d.queue_time,
                                     error=d.error, stop_str=det.stopped if reason == "stop" else None,
                                     embedding=d.embedding))
        if out or parse_inits:
            push.send(tx.encode(TextBatch(out, parse_inits, batch.resync)))

    process.started("xinfer::detokenizer")
    process.frame_loop(pull, rx, handle, parent)

"""The engine core process: receives requests from the API process over ZMQ, runs the
scheduler and the model, and sends back each step's outputs in one frame.

Today the model worker and detokenization run inside this process (the offline Engine);
the message types are the ones the split processes will keep using.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time

import zmq

from xinfer.config import EngineConfig
from xinfer.errors import XinferError
from xinfer.ipc.api import (Abort, FromEngine, GenerateRequest, Output, Outputs, Ready, RequestError, Stats,
                            ToEngine)
from xinfer.ipc.channels import Codec, socket
from xinfer.ipc.step import pack_ids, unpack_ids

log = logging.getLogger("xinfer.engine_core")


def run_engine_core(config: EngineConfig, in_addr: str, out_addr: str, log_level: str = "info") -> None:
    from xinfer.cli import set_title, setup_logging
    from xinfer.engine import Engine

    setup_logging(log_level, "xinfer::engine")
    set_title("xinfer::engine")
    parent = os.getppid()
    ctx = zmq.Context()
    pull = socket(ctx, zmq.PULL, in_addr, bind=False)
    push = socket(ctx, zmq.PUSH, out_addr, bind=False)
    rx, tx = Codec(ToEngine), Codec(FromEngine)
    # SIGTERM (the API process stopping us) unwinds through the finally: the worker and
    # the shared-memory rings are released.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    engine = Engine(config, worker="process", log_level=log_level)
    try:
        push.send(tx.encode(Ready(engine.info.name, engine.max_model_len)))
        log.info("ready")
        _serve(engine, pull, push, rx, tx, parent)
    finally:
        engine.close()


def _stats(engine) -> Stats:
    s = engine.scheduler
    return Stats(len(s.running), len(s.waiting), engine.blocks.usage(), engine.num_prompt_tokens,
                 engine.num_generation_tokens, engine.num_cached_prompt_tokens, s.num_preemptions,
                 getattr(engine.runner, "restarts", 0))


def _serve(engine, pull, push, rx, tx, parent: int) -> None:
    last_stats = None
    while True:
        stats = _stats(engine)
        if stats != last_stats:  # sent when something changed, so an idle engine sends nothing
            push.send(tx.encode(stats))
            last_stats = stats
        busy = engine.has_unfinished()
        # Block while idle (an idle server burns no core); only drain the queue while busy.
        timeout = 0 if busy else 500
        while pull.poll(timeout):
            msg = rx.decode(pull.recv())
            timeout = 0
            if isinstance(msg, GenerateRequest):
                try:
                    engine.add_request(unpack_ids(msg.prompt_ids), msg.params, msg.request_id)
                except XinferError as e:
                    push.send(tx.encode(RequestError(msg.request_id, str(e))))
            elif isinstance(msg, Abort):
                engine.abort_request(msg.request_id)
        if not engine.has_unfinished():
            if os.getppid() != parent:  # the API process is gone: nothing to serve
                log.warning("parent exited; stopping")
                return
            continue
        t = time.perf_counter()
        deltas = engine.step()
        log.debug("step %.1f ms, %d outputs", (time.perf_counter() - t) * 1e3, len(deltas))
        if deltas:
            push.send(tx.encode(Outputs([
                Output(d.request_id, d.index, pack_ids(d.token_ids), d.text, d.finish_reason,
                       engine.get_num_cached_tokens_for_seq(d.seq_id)) for d in deltas])))

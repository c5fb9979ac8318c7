"""The engine core (scheduler) process.

Requests arrive from the API process over ZMQ. Each step runs on the model worker process
(shared-memory rings, see workers/worker.py); the new token ids go to the detokenizer
process, whose text goes through the parser process to the API. A stop string found by the
detokenizer comes back here and frees the sequence at once.

This process holds every live sequence's tokens, so any child can die without losing a
request: a new worker recomputes from the tokens, and a new detokenizer/parser pair is
resynchronised with every live sequence's whole output (the API keeps only the text it has
not seen yet).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import time

import zmq

from xinfer.config import EngineConfig
from xinfer.errors import XinferError
from xinfer.ipc import launch
from xinfer.ipc.api import Abort, FromEngine, GenerateRequest, Ready, RequestError, Stats, ToEngine
from xinfer.ipc.channels import Codec, endpoint, socket
from xinfer.ipc.step import pack_ids, unpack_ids
from xinfer.ipc.text import SeqInit, StopHit, TokenBatch, TokenDelta
from xinfer.workers.detokenizer import run_detokenizer
from xinfer.workers.parser import run_parser

log = logging.getLogger("xinfer.engine_core")

_PROMPT_TAIL = 8
_KEEP_FINISHED_S = 60.0  # finished sequences stay resendable this long after a pipeline restart


def run_engine_core(config: EngineConfig, rundir: str, in_addr: str, out_addr: str, log_level: str,
                    parent: int) -> None:
    """`parent` is the supervisor: when it is gone, this process stops (it is passed in rather
    than read here, since the parent may die while this process is still starting)."""
    from xinfer.cli import set_title, setup_logging
    from xinfer.engine import Engine

    name = "xinfer::scheduler"
    setup_logging(log_level, name)
    set_title(name)
    # SIGTERM (the supervisor stopping us) unwinds through the finally clauses: the children
    # and the shared-memory rings are released. Ctrl-C is the supervisor's to handle (it
    # drains first); the children started from here inherit the ignored SIGINT.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    launch.exit_with_parent(parent)  # the loop below checks too; this also covers a long model load
    core = EngineCore(config, rundir, in_addr, out_addr, log_level, parent)
    try:
        engine = Engine(config, worker="process", log_level=log_level, detokenize=False)
    except Exception as e:  # a bad model or flag: the supervisor shows the message and stops
        log.debug("start-up failed", exc_info=True)
        _fail(name, e)
    try:
        core.budget = engine.restart_budget
        core.start_pipeline()
        core.push.send(core.tx.encode(Ready(engine.info.name, engine.max_model_len, os.getpid())))
        launch.started(name, [p.name for p in core.procs])
        log.info("ready")
        core.serve(engine)
    except XinferError as e:  # e.g. too many child restarts: a clear message, no traceback
        _fail(name, e)
    except Exception as e:
        log.exception("stopped by an unexpected error")
        _fail(name, e)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
        core.stop_pipeline()
        engine.close()
        if core.orphaned or os.getppid() != parent:  # nobody is left to clean up or to wait: be gone
            shutil.rmtree(rundir, ignore_errors=True)
            logging.shutdown()
            os._exit(1)


def _fail(name: str, e: Exception):
    message = str(e) if isinstance(e, XinferError) else f"{type(e).__name__}: {e}"
    log.error("%s", message)
    launch.failed(name, message)
    raise SystemExit(1)


class EngineCore:
    def __init__(self, config: EngineConfig, rundir: str, in_addr: str, out_addr: str, log_level: str,
                 parent: int):
        self.config, self.rundir, self.out_addr, self.log_level = config, rundir, out_addr, log_level
        self.ctx = zmq.Context()
        self.pull = socket(self.ctx, zmq.PULL, in_addr, bind=False)
        self.stop_addr = endpoint(rundir, "stop_hits")
        self.pull.bind(self.stop_addr)  # the detokenizer's stop-string hits arrive here too
        self.push = socket(self.ctx, zmq.PUSH, out_addr, bind=False)
        self.rx, self.tx = Codec(ToEngine | StopHit), Codec(FromEngine)
        self.tok_codec = Codec(TokenBatch)
        self.parent = parent
        self.live: dict[int, dict] = {}  # seq id -> what the detokenizer needs to rebuild its text
        self.new_inits: list[SeqInit] = []
        self.gen = 0
        self.procs: list = []
        self.to_detok = None
        self.pipeline_restarts = 0
        self.budget = None  # the engine's RestartBudget, shared with worker restarts
        self.orphaned = False
        self.last_stats = None  # the last Stats sent to the API

    # ---- the detokenizer -> parser pipeline ----
    def start_pipeline(self) -> None:
        self.gen += 1
        to_detok, to_parser = endpoint(self.rundir, f"to_detok-{self.gen}"), endpoint(self.rundir,
                                                                                       f"to_parser-{self.gen}")
        self.to_detok = socket(self.ctx, zmq.PUSH, to_detok, bind=True)
        # A send to a dead detokenizer would block forever: time out and check on it instead.
        self.to_detok.setsockopt(zmq.SNDTIMEO, 1000)
        spawn = mp.get_context("spawn")
        # The parser binds its input before the detokenizer connects; ZMQ queues until then.
        self.procs = [
            spawn.Process(target=run_parser, name="xinfer::parser", daemon=True,
                          args=(to_parser, self.out_addr, self.log_level, os.getpid())),
            spawn.Process(target=run_detokenizer, name="xinfer::detokenizer", daemon=True,
                          args=(self.config.model, self.config.load_format, to_detok, to_parser, self.stop_addr,
                                self.log_level, os.getpid())),
        ]
        for p in self.procs:
            p.start()

    def stop_pipeline(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        if self.to_detok is not None:
            self.to_detok.close()

    def _send_detok(self, batch: TokenBatch) -> None:
        frame = self.tok_codec.enc.encode(batch)
        while True:
            try:
                self.to_detok.send(frame)
                return
            except zmq.Again:
                if self._check_pipeline():
                    return  # restarted: the resync carried this batch's content too

    def _check_pipeline(self) -> bool:
        """Restart the detokenizer/parser pair if either died; True if it did."""
        if all(p.is_alive() for p in self.procs):
            return False
        self.pipeline_restarts += 1
        dead = [p.name for p in self.procs if not p.is_alive()]
        if self.budget is not None:
            self.budget.record(" and ".join(dead), "exit code " + ", ".join(
                str(p.exitcode) for p in self.procs if not p.is_alive()))
        log.warning("%s died; restarting the detokenizer/parser pair and resending %d sequences",
                    ", ".join(dead), len(self.live))
        self.stop_pipeline()
        self.start_pipeline()
        self.new_inits = []
        inits = [s["init"] for s in self.live.values()]
        deltas = [TokenDelta(sid, pack_ids(s["tokens"]), s["finish"], s["cached"], s["logprobs"],
                             s["prompt_logprobs"], s["queue_time"]) for sid, s in self.live.items()]
        self._send_detok(TokenBatch(inits, deltas, resync=True))
        return True

    # ---- the loop ----
    def serve(self, engine) -> None:
        while True:
            self._check_pipeline()
            self._send_stats(engine)
            # Block while idle (an idle server burns no core); only drain the queue while busy.
            timeout = 0 if engine.has_unfinished() else 500
            while self.pull.poll(timeout):
                timeout = 0
                self._handle(engine, self.rx.decode(self.pull.recv()))
            self._purge()
            if os.getppid() != self.parent:  # the supervisor is gone (even SIGKILLed): stop
                log.warning("the supervisor exited; stopping")
                self.orphaned = True
                return
            if not engine.has_unfinished():
                engine.check_worker()  # a worker that died while idle is replaced now
                continue
            t = time.perf_counter()
            deltas = engine.step()
            log.debug("step %.1f ms, %d outputs", (time.perf_counter() - t) * 1e3, len(deltas))
            out = []
            for d in deltas:
                s = self.live.get(d.seq_id)
                if s is None:
                    continue
                s["tokens"].extend(d.token_ids)
                s["cached"] = engine.get_num_cached_tokens_for_seq(d.seq_id)
                if d.logprobs is not None:
                    s["logprobs"] = s["logprobs"] or []
                    s["logprobs"].extend(d.logprobs)
                if d.prompt_logprobs is not None:
                    s["prompt_logprobs"] = d.prompt_logprobs
                s["queue_time"] = d.queue_time
                if d.finish_reason:
                    self._done(s, d.finish_reason)
                out.append(TokenDelta(d.seq_id, pack_ids(d.token_ids), d.finish_reason, s["cached"], d.logprobs,
                                      d.prompt_logprobs, d.queue_time))
            # The counters first: they go straight to the API, the tokens through two more
            # processes, so /metrics already counts a request when its response ends.
            self._send_stats(engine)
            self._send_tokens(out)

    def _send_stats(self, engine) -> None:
        stats = _stats(engine)
        if stats != self.last_stats:  # sent when something changed, so an idle engine sends nothing
            self.push.send(self.tx.encode(stats))
            self.last_stats = stats

    def _handle(self, engine, msg) -> None:
        if isinstance(msg, GenerateRequest):
            try:
                ids = unpack_ids(msg.prompt_ids)
                seq_ids = engine.add_request(ids, msg.params, msg.request_id)
            except XinferError as e:
                self.push.send(self.tx.encode(RequestError(msg.request_id, str(e))))
                return
            tail = pack_ids(ids[-_PROMPT_TAIL:])
            for index, sid in enumerate(seq_ids):
                init = SeqInit(sid, msg.request_id, index, tail, list(msg.params.stop),
                               msg.params.skip_special_tokens, msg.parse)
                self.live[sid] = {"init": init, "tokens": [], "finish": None, "cached": 0, "done_at": None,
                                  "request_id": msg.request_id, "logprobs": None, "prompt_logprobs": None,
                                  "queue_time": 0.0}
                self.new_inits.append(init)
        elif isinstance(msg, Abort):
            gone = [sid for sid, s in self.live.items() if s["request_id"] == msg.request_id and not s["finish"]
                    and msg.index in (-1, s["init"].index)]
            for sid in gone:
                engine.abort(sid)
            self._finish_here(gone, "abort")
        elif isinstance(msg, StopHit):
            s = self.live.get(msg.seq_id)
            if s is not None and not s["finish"]:
                engine.abort(msg.seq_id)
                self._done(s, "stop")

    def _finish_here(self, seq_ids, reason) -> None:
        """Sequences that end here, not in a step: tell the detokenizer to drop them."""
        for sid in seq_ids:
            self._done(self.live[sid], reason)
        self._send_tokens([TokenDelta(sid, b"", reason, 0) for sid in seq_ids])

    def _done(self, s, reason) -> None:
        s["finish"], s["done_at"] = reason, time.monotonic()

    def _send_tokens(self, deltas) -> None:
        if deltas or self.new_inits:
            batch, self.new_inits = TokenBatch(self.new_inits, deltas), []
            self._send_detok(batch)

    def _purge(self) -> None:
        now = time.monotonic()
        for sid in [sid for sid, s in self.live.items() if s["done_at"] and now - s["done_at"] > _KEEP_FINISHED_S]:
            del self.live[sid]


def _stats(engine) -> Stats:
    s = engine.scheduler
    return Stats(len(s.running), len(s.waiting), engine.blocks.usage(), engine.num_prompt_tokens,
                 engine.num_generation_tokens, engine.num_cached_prompt_tokens, s.num_preemptions,
                 getattr(engine.runner, "restarts", 0))

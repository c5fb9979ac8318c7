"""The engine core's process (xinfer::scheduler): an EngineCore driven by ZMQ.

Requests arrive from the API process. Each step runs on the model worker process (shared-memory
rings, xinfer/workers/worker.py); the new token ids go to the detokenizer process, whose text
goes through the parser process to the API. A stop string found by the detokenizer comes back
here and frees the sequence at once.

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
import time
from dataclasses import dataclass

import zmq

from xinfer import process
from xinfer import parallel, spec
from xinfer.config import EngineConfig
from xinfer.engine_core import Delta, EngineCore
from xinfer.ipc.api import Abort, FromEngine, GenerateRequest, Ready, RequestError, Stats, ToEngine
from xinfer.ipc.channels import Codec, socket
from xinfer.ipc.step import pack_ids, unpack_ids
from xinfer.ipc.text import SeqInit, StopHit, TokenBatch, TokenDelta
from xinfer.ipc.topology import Topology
from xinfer.loader import load_model_info
from xinfer.scheduler import Sequence
from xinfer.workers.detokenizer import run_detokenizer
from xinfer.workers.parser import run_parser
from xinfer.workers.worker import ProcessRunner

log = logging.getLogger("xinfer.engine_core")

NAME = "xinfer::scheduler"
_PROMPT_TAIL = 8
_KEEP_FINISHED_S = 60.0
_STATS_EVERY_S = 0.25  # finished sequences stay resendable this long after a pipeline restart


def run_engine_core(config: EngineConfig, topology: Topology, log_level: str, parent: int) -> None:
    """`parent` is the supervisor: when it is gone, this process stops (it is passed in rather
    than read here, since the parent may die while this process is still starting)."""
    process.run_process(NAME, log_level, _main, config, topology, log_level, parent, parent=parent)


def _main(config: EngineConfig, topology: Topology, log_level: str, parent: int) -> None:
    proc = EngineCoreProc(config, topology, log_level, parent)
    try:
        info = load_model_info(config.model, config.load_format)
        config.resolve(info.config)
        config.resolve_quantization(info.has_blocks)
        spec.check(config, info)
        parallel.check(config, info.config)
        proc.tokenizer = info.tokenizer.to_spec() if info.tokenizer is not None else None
        proc.start_pipeline()  # before the model loads: the detokenizer and parser start beside it
        proc.core = EngineCore(config, info, ProcessRunner(config, topology, log_level))
        core = proc.core  # its max_model_len is capped by the KV cache: what the API goes by
        proc.push.send(proc.tx.encode(Ready(info.name, core.max_model_len, os.getpid(), core.blocks.num_blocks,
                                            config.block_size)))
        process.started(NAME, [p.name for p in proc.procs])
        log.info("ready")
        proc.serve()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
        proc.close()
        if proc.orphaned or os.getppid() != parent:  # nobody is left to clean up or to wait: be gone
            shutil.rmtree(topology.rundir, ignore_errors=True)
            logging.shutdown()
            os._exit(1)


def _shape(s: Stats) -> tuple:
    return s.num_running, s.num_waiting, s.preemptions, s.worker_restarts


@dataclass
class _Live:
    """A choice the detokenizer/parser pair knows about: what a restarted pair is resent."""
    seq: Sequence
    init: SeqInit
    done_at: float | None = None


class EngineCoreProc:
    def __init__(self, config: EngineConfig, topology: Topology, log_level: str, parent: int):
        self.config, self.topology, self.log_level, self.parent = config, topology, log_level, parent
        self.core: EngineCore | None = None
        self.tokenizer: tuple | None = None  # Tokenizer.to_spec(), for the detokenizer
        self.ctx = zmq.Context()
        self.pull = socket(self.ctx, zmq.PULL, topology.to_engine, bind=False)
        self.pull.bind(topology.stop_hits)  # the detokenizer's stop-string hits arrive here too
        self.push = socket(self.ctx, zmq.PUSH, topology.from_engine, bind=False)
        self.rx, self.tx = Codec(ToEngine | StopHit), Codec(FromEngine)
        self.tok_codec = Codec(TokenBatch)
        self.live: dict[int, _Live] = {}
        self.new_inits: list[SeqInit] = []
        self.gen = 0
        self.procs: list = []
        self.to_detok = None
        self.orphaned = False
        self.last_stats = None  # the last Stats sent to the API
        self._next_purge = 0.0
        self._stats_due = 0.0

    # ---- the detokenizer -> parser pipeline ----
    def start_pipeline(self) -> None:
        self.gen += 1
        t, g = self.topology, self.gen
        self.to_detok = socket(self.ctx, zmq.PUSH, t.to_detokenizer(g), bind=True)
        # A send with no detokenizer connected blocks (a PUSH socket without peers): time out soon and
        # check on it, so a dead one is replaced within a step, not a second.
        self.to_detok.setsockopt(zmq.SNDTIMEO, 100)
        spawn = mp.get_context("spawn")
        # The parser binds its input before the detokenizer connects; ZMQ queues until then.
        self.procs = [
            spawn.Process(target=run_parser, name="xinfer::parser", daemon=True,
                          args=(t, g, self.log_level, os.getpid())),
            spawn.Process(target=run_detokenizer, name="xinfer::detokenizer", daemon=True,
                          args=(self.tokenizer, t, g, self.log_level, os.getpid())),
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

    def close(self) -> None:
        self.stop_pipeline()
        if self.core is not None:
            self.core.close()

    def _send_detok(self, batch: TokenBatch) -> None:
        frame = self.tok_codec.encode(batch)
        while True:
            if self._check_pipeline():
                return  # restarted: the resync carried this batch's content too
            try:
                self.to_detok.send(frame)
                return
            except zmq.Again:
                pass

    def _check_pipeline(self) -> bool:
        """Restart the detokenizer/parser pair if either died; True if it did."""
        if all(p.is_alive() for p in self.procs):
            return False
        t0 = time.monotonic()
        dead = [p.name for p in self.procs if not p.is_alive()]
        self.core.restart_budget.record(" and ".join(dead), "exit code " + ", ".join(
            str(p.exitcode) for p in self.procs if not p.is_alive()))
        log.warning("%s died; restarting the detokenizer/parser pair and resending %d sequences",
                    ", ".join(dead), len(self.live))
        self.stop_pipeline()
        self.start_pipeline()
        self.new_inits = []
        deltas = [self._resend(e) for e in self.live.values()]
        self._send_detok(TokenBatch([e.init for e in self.live.values()], deltas, resync=True))
        for name in dead:
            self.core.restart_budget.took(name, time.monotonic() - t0)
        return True

    def _resend(self, e: _Live) -> TokenDelta:
        """A choice's whole output so far, as one delta."""
        d = self.core.delta(e.seq, e.seq.output_ids)
        if e.seq.params.prompt_logprobs is not None:  # a first delta carries them
            d.prompt_logprobs = [None] + e.seq.prompt_logprobs
        return self._token_delta(d)

    # ---- the loop ----
    def serve(self) -> None:
        core = self.core
        while True:
            self._check_pipeline()
            self._send_stats()
            # Block while idle (an idle server burns no core); only drain the queue while busy.
            timeout = 0 if core.has_unfinished() else 500
            while self.pull.poll(timeout):
                timeout = 0
                self._handle(self.rx.decode(self.pull.recv()))
            self._purge()
            if os.getppid() != self.parent:  # the supervisor is gone (even SIGKILLed): stop
                log.warning("the supervisor exited; stopping")
                self.orphaned = True
                return
            if not core.has_unfinished():
                core.check_worker()  # a worker that died while idle is replaced now
                continue
            t = time.perf_counter()
            deltas = core.step()
            log.debug("step %.1f ms, %d outputs", (time.perf_counter() - t) * 1e3, len(deltas))
            now = time.monotonic()
            out = []
            for d in deltas:
                e = self.live.get(d.seq_id)
                if e is not None:
                    if d.finish_reason:
                        e.done_at = now
                    out.append(self._token_delta(d))
            # The counters first: they go straight to the API, the tokens through two more
            # processes, so /metrics already counts a request when its response ends.
            self._send_stats(force=any(d.finish_reason for d in deltas))
            self._send_tokens(out)

    def _token_delta(self, d: Delta) -> TokenDelta:
        return TokenDelta(d.seq_id, pack_ids(d.token_ids), d.finish_reason, self.core.num_cached_tokens(d.seq_id),
                          d.logprobs, d.prompt_logprobs, d.queue_time, d.error, d.embedding)

    def _send_stats(self, force: bool = False) -> None:
        """Sent when something changed, so an idle engine sends nothing. Counters that move every
        step (tokens, KV use) go at most every _STATS_EVERY_S: a message a token costs the API process
        and this one more CPU than the whole step's bookkeeping, on cores the model needs. Gauges of
        running and waiting requests, and `force` (a request finished), go at once."""
        stats, last = self.core.stats(), self.last_stats
        if stats == last:
            return
        now = time.monotonic()
        if (not force and last is not None and now < self._stats_due
                and _shape(stats) == _shape(last)):
            return
        self.push.send(self.tx.encode(stats))
        self.last_stats, self._stats_due = stats, now + _STATS_EVERY_S

    def _handle(self, msg) -> None:
        if isinstance(msg, GenerateRequest):
            self._add(msg)
        elif isinstance(msg, Abort):
            gone = [sid for sid, e in self.live.items() if e.seq.request_id == msg.request_id and not e.done_at
                    and msg.index in (-1, e.seq.index)]
            for sid in gone:
                self.core.abort(sid)
            self._finish_here(gone, "abort")
        elif isinstance(msg, StopHit):
            e = self.live.get(msg.seq_id)
            if e is not None and not e.done_at:
                self.core.abort(msg.seq_id, "stop")
                e.done_at = time.monotonic()

    def _add(self, msg: GenerateRequest) -> None:
        """A request the API process has checked (check_request); only what it cannot know is
        caught here, and answered with an error instead of taking the process down."""
        try:
            ids = unpack_ids(msg.prompt_ids)
            seqs = self.core.add_request(msg.request_id, ids, msg.params, msg.images)
        except Exception as e:
            log.warning("request %s refused: %s", msg.request_id, e)
            self.push.send(self.tx.encode(RequestError(msg.request_id, str(e))))
            return
        tail = pack_ids(ids[-_PROMPT_TAIL:])
        for s in seqs:
            init = SeqInit(s.seq_id, msg.request_id, s.index, tail, list(msg.params.stop),
                           msg.params.skip_special_tokens, msg.parse, msg.params.include_stop_str_in_output)
            self.live[s.seq_id] = _Live(s, init)
            self.new_inits.append(init)

    def _finish_here(self, seq_ids, reason) -> None:
        """Sequences that end here, not in a step: tell the detokenizer to drop them."""
        for sid in seq_ids:
            self.live[sid].done_at = time.monotonic()
        self._send_tokens([TokenDelta(sid, b"", reason, 0) for sid in seq_ids])

    def _send_tokens(self, deltas) -> None:
        if deltas or self.new_inits:
            batch, self.new_inits = TokenBatch(self.new_inits, deltas), []
            self._send_detok(batch)

    def _purge(self) -> None:
        now = time.monotonic()
        if now < self._next_purge:  # once a second is enough; each purge walks every live entry
            return
        self._next_purge = now + 1.0
        for sid in [sid for sid, e in self.live.items() if e.done_at and now - e.done_at > _KEEP_FINISHED_S]:
            del self.live[sid]

"""The engine core: every request's state, and the step that advances them all.

`EngineCore.step()` is three calls: the scheduler picks the batch (schedule), the runner runs
it (execute), the scheduler applies the sampled tokens (update). Nothing here knows about
text, sockets or processes: the offline `Engine` (xinfer/engine.py) and the serving process
(`EngineCoreProc`, xinfer/engine_core_proc.py) both drive this same object.

Requests are trusted here: they were checked once, by `check_request` (xinfer/sampling_params.py),
in the API process or in the offline Engine.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from xinfer.config import EngineConfig
from xinfer.ipc.api import Stats
from xinfer.kv_cache import BlockManager
from xinfer.loader import ModelInfo
from xinfer.sampling_params import SEED_MASK, SamplingParams
from xinfer.scheduler import FINISHED, Scheduler, Sequence
from xinfer.workers.runner import RestartBudget, Runner, WorkerDied

log = logging.getLogger("xinfer.engine_core")

@dataclass
class Delta:
    """One streaming event: the new tokens and text of one sequence since the last event."""
    seq_id: int
    request_id: str
    index: int  # which of the request's n choices
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list | None = None  # per new token, when asked: (logprob, [(token id, logprob), ...])
    prompt_logprobs: list | None = None  # with the first delta, when asked: None for token 0, then entries
    queue_time: float = 0.0  # with the last delta: seconds from arrival to first scheduled
    error: str | None = None  # with finish_reason "error": why the request could not be run


_KEEP_FINISHED = 4096  # finished sequences remembered (cached-token counts); bounded: a server runs forever


class EngineCore:
    def __init__(self, config: EngineConfig, info: ModelInfo, runner: Runner):
        """`runner` is started: it sized the KV cache after loading the weights."""
        self.config, self.info, self.runner = config, info, runner
        cap = runner.num_blocks * config.block_size  # a longer sequence could never run
        if config.max_model_len > cap:
            log.info("max_model_len %d capped to %d: what the KV cache holds for one sequence",
                     config.max_model_len, cap)
        self.max_model_len = min(config.max_model_len, cap)
        self.blocks = BlockManager(runner.num_blocks, config.block_size, config.enable_prefix_cache,
                                   config.prefix_cache_max_tokens)
        self.scheduler = Scheduler(config, self.blocks, self.max_model_len, info.eos_token_ids)
        self.restart_budget = RestartBudget(config.max_restarts, config.restart_window)
        self._ids = itertools.count()
        self._zero: list[Sequence] = []  # max_tokens=0 requests: finished without running
        self.finished: OrderedDict[int, Sequence] = OrderedDict()
        self.num_prompt_tokens = self.num_generation_tokens = self.num_cached_prompt_tokens = 0

    # ---- requests ----
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> list[Sequence]:
        """Queue one checked request; returns its n choices."""
        max_tokens = self.max_model_len - len(prompt_ids) if params.max_tokens is None else params.max_tokens
        seqs = [Sequence(next(self._ids), request_id, list(prompt_ids), params,
                         None if params.seed is None else (params.seed + i) & SEED_MASK, max_tokens, index=i)
                for i in range(params.n)]
        if max_tokens == 0 and params.prompt_logprobs is None:
            for s in seqs:
                s.status, s.finish_reason, s.finish_time = FINISHED, "length", time.time()
            self._zero.extend(seqs)
        else:
            self.scheduler.add(seqs[0], seqs[1:])
        return seqs

    def abort(self, seq_id: int, reason: str = "abort") -> None:
        seq = self.scheduler.abort(seq_id, reason)
        if seq is not None:
            self._remember(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._zero)

    def num_cached_tokens(self, seq_id: int) -> int:
        seq = self.scheduler.seqs.get(seq_id) or self.finished.get(seq_id)
        return (seq.num_cached_tokens or 0) if seq is not None else 0

    # ---- the step ----
    def step(self) -> list[Delta]:
        """One step: a Delta (without text) for every sequence that moved, in batch order."""
        out = [self.delta(s, []) for s in self._zero] + self._expire()
        self._zero = []
        if not self.scheduler.has_work():
            return out
        plan = self.scheduler.schedule()
        try:
            result = self.runner.execute(plan)
        except WorkerDied as e:
            self.recover(e)
            return out + self._strike(plan, f"the model worker died running it ({e})")
        if result.error is not None:  # the worker lives on; its batch is gone: recompute everything
            self.scheduler.reset_worker_state()
            return out + self._strike(plan, f"the model step failed ({result.error})")
        for seq, tok in self.scheduler.update(result):
            toks = [] if tok is None else [tok]
            self.num_generation_tokens += len(toks)
            if len(seq.output_ids) <= 1 and (toks or seq.finish_reason):
                self.num_prompt_tokens += len(seq.prompt_ids)
                self.num_cached_prompt_tokens += seq.num_cached_tokens or 0
            if seq.finish_reason:
                self._remember(seq)
            out.append(self.delta(seq, toks))
        return out

    def delta(self, seq: Sequence, toks: list[int]) -> Delta:
        """What `seq` adds with its new tokens `toks` (its whole output so far, for a resend)."""
        d = Delta(seq.seq_id, seq.request_id, seq.index, toks, "", seq.finish_reason, error=seq.error)
        if seq.params.logprobs is not None and toks:
            d.logprobs = seq.logprobs[-len(toks):]
        if seq.params.prompt_logprobs is not None and len(seq.output_ids) <= 1:
            d.prompt_logprobs = [None] + seq.prompt_logprobs
        if seq.finish_reason and seq.scheduled_time is not None:
            d.queue_time = max(0.0, seq.scheduled_time - seq.arrival_time)
        return d

    def _expire(self) -> list[Delta]:
        """--max-queue-wait: requests that never got a step in time end as "timeout" (retry later)."""
        limit = self.config.max_queue_wait
        if limit is None:
            return []
        old, expired = time.time() - limit, []
        for s in self.scheduler.waiting:
            if s.scheduled_time is not None:  # preempted: it had its first step
                continue
            if s.arrival_time >= old:  # never-started ones wait in arrival order: the rest are newer
                break
            expired.append(s)
        out = []
        for seq in expired:
            seq.error = f"the request waited over {limit:g}s for a place in the running batch"
            self.abort(seq.seq_id, "timeout")
            out.append(self.delta(seq, []))
        return out

    def _strike(self, plan, why: str) -> list[Delta]:
        """The poison-pill rule: every sequence of a failed step runs alone next (Scheduler.suspects);
        one that fails a second time is the cause and ends with an error, so a request that breaks
        the model can't replay itself into every new worker until the server gives up."""
        out = []
        for sid in [s.seq_id for s in plan.scheduled]:
            seq = self.scheduler.seqs.get(sid)
            if seq is None:
                continue
            seq.strikes += 1
            if seq.strikes == 1:
                self.scheduler.suspects.append(seq)
                continue
            log.warning("request %s aborted: %s a second time", seq.request_id, why)
            seq.error = f"this request could not be run: {why}"
            self.abort(seq.seq_id, "error")
            out.append(self.delta(seq, []))
        return out

    def _remember(self, seq: Sequence) -> None:
        self.finished[seq.seq_id] = seq
        while len(self.finished) > _KEEP_FINISHED:
            self.finished.popitem(last=False)

    # ---- faults ----
    def recover(self, err: Exception) -> None:
        """A worker died: start a new one and recompute every running sequence from its tokens.
        Clients see a slower response, not an error; greedy outputs are unchanged."""
        t0 = time.monotonic()
        while True:  # a worker that dies while it starts counts as one more restart
            self.restart_budget.record("xinfer::worker-0", str(err))
            log.warning("model worker died (%s); restarting it and recomputing %d sequences", err,
                        len(self.scheduler.running))
            self.scheduler.reset_worker_state()
            try:
                self.runner.restart()
                self.restart_budget.took("xinfer::worker-0", time.monotonic() - t0)
                return
            except WorkerDied as e:
                err = e

    def check_worker(self) -> None:
        """Restart a worker that died while the engine was idle (before a request needs it)."""
        why = self.runner.dead()
        if why:
            self.recover(WorkerDied(why))

    def stats(self) -> Stats:
        s = self.scheduler
        return Stats(len(s.running), len(s.waiting), self.blocks.usage(), self.num_prompt_tokens,
                     self.num_generation_tokens, self.num_cached_prompt_tokens, s.num_preemptions,
                     self.runner.restarts, [(c, n, t) for c, (n, t) in self.restart_budget.seconds.items()])

    def close(self) -> None:
        self.runner.close()

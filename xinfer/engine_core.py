"""The engine core: every request's state, and the step that advances them all.

`EngineCore.step()` is three calls: the scheduler picks the batch (schedule), the runner runs
it (submit, collect), the scheduler applies the sampled tokens (update). With overlap (on CUDA
by default), the next step is planned and sent before this one's result is read, so the worker
never waits for the scheduler between steps. Nothing here knows about
text, sockets or processes: the offline `Engine` (xinfer/engine.py) and the serving process
(`EngineCoreProc`, xinfer/engine_core_proc.py) both drive this same object.

Requests are trusted here: they were checked once, by `check_request` (xinfer/sampling_params.py),
in the API process or in the offline Engine.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from xinfer import hybrid, spec
from xinfer.config import EngineConfig
from xinfer.ipc.api import Stats
from xinfer.kv_cache import BlockManager
from xinfer.loader import ModelInfo
from xinfer.sampling_params import SEED_MASK, SamplingParams
from xinfer.scheduler import FINISHED, Scheduler, Sequence
from xinfer.structured import Grammars
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
    embedding: bytes = b""  # an embedding request's last delta: its vector (float32 bytes)


# finished sequences' cached-token counts remembered (Engine.get_num_cached_tokens_for_seq); bounded, and
# only the count: a whole Sequence holds its tokens (and images), 4096 of them hundreds of MB
_KEEP_FINISHED = 4096


class EngineCore:
    def __init__(self, config: EngineConfig, info: ModelInfo, runner: Runner):
        """`runner` is started: it sized the KV cache after loading the weights."""
        self.config, self.info, self.runner = config, info, runner
        cap = runner.num_blocks * config.block_size  # a longer sequence could never run
        if config.max_model_len > cap:
            log.info("max_model_len %d capped to %d: what the KV cache holds for one sequence",
                     config.max_model_len, cap)
        self.max_model_len = min(config.max_model_len, cap)
        slots = hybrid.setup(config, info.config)  # a hybrid model's recurrent-state slots, else None
        cache = config.enable_prefix_cache and (slots is None or slots.snapshots > 0)  # hybrids: hits need snapshots
        self.blocks = BlockManager(runner.num_blocks, config.block_size, cache, config.prefix_cache_max_tokens)
        self.scheduler = Scheduler(config, self.blocks, self.max_model_len, info.eos_token_ids,
                                   spec.method(config, info.config), slots)
        self._spec_logged = (time.monotonic(), 0, 0, 0)  # when, and the counters then
        self.restart_budget = RestartBudget(config.max_restarts, config.restart_window)
        self._ids = itertools.count()
        self._zero: list[Sequence] = []  # max_tokens=0 requests: finished without running
        self.grammars = Grammars(info.tokenizer, info.config["vocab_size"], info.eos_token_ids)
        # constrained requests whose grammar compiles (off the loop): (future, choices, deadline)
        self._compiling: list[tuple[concurrent.futures.Future, list[Sequence], float]] = []
        self.finished: OrderedDict[int, int] = OrderedDict()
        self._pending = None  # the step sent ahead (overlap), whose result the next step() reads
        self.num_prompt_tokens = self.num_generation_tokens = self.num_cached_prompt_tokens = 0

    # ---- requests ----
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    images: list | None = None) -> list[Sequence]:
        """Queue one checked request; returns its n choices. `images`: the prompt's ImageData."""
        max_tokens = self.max_model_len - len(prompt_ids) if params.max_tokens is None else params.max_tokens
        seqs = [Sequence(next(self._ids), request_id, list(prompt_ids), params,
                         None if params.seed is None else (params.seed + i) & SEED_MASK, max_tokens, index=i,
                         images=list(images or ()))
                for i in range(params.n)]
        if max_tokens == 0 and params.prompt_logprobs is None and not params.embed:
            for s in seqs:
                s.status, s.finish_reason, s.finish_time = FINISHED, "length", time.time()
            self._zero.extend(seqs)
        elif params.structured is not None:
            deadline = time.monotonic() + self.config.grammar_compile_timeout
            self._compiling.append((self.grammars.submit(params.structured), seqs, deadline))
        else:
            self.scheduler.add(seqs[0], seqs[1:])
        return seqs

    def abort(self, seq_id: int, reason: str = "abort") -> None:
        seq = self.scheduler.abort(seq_id, reason)
        if seq is None:
            seq = self._drop_compiling(seq_id)
            if seq is None:
                return
            seq.status, seq.finish_reason, seq.finish_time = FINISHED, reason, time.time()
        seq.grammar = None
        self._remember(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._zero) or bool(self._compiling) or self._pending is not None

    # ---- structured outputs ----
    def _drop_compiling(self, seq_id: int) -> Sequence | None:
        for entry in self._compiling:
            for seq in entry[1]:
                if seq.seq_id == seq_id:
                    entry[1].remove(seq)
                    if not entry[1]:
                        self._compiling.remove(entry)
                    return seq
        return None

    def _admit_compiled(self) -> list[Delta]:
        """Constrained requests whose grammar is ready join the scheduler; a grammar that failed
        (or ran past --grammar-compile-timeout) ends its request with the reason."""
        if not self.scheduler.has_work():  # nothing else to do: wait a little instead of spinning
            concurrent.futures.wait([f for f, _, _ in self._compiling], timeout=0.01,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        out, now, keep = [], time.monotonic(), []
        for fut, seqs, deadline in self._compiling:
            if not fut.done() and now < deadline:
                keep.append((fut, seqs, deadline))
                continue
            error = None
            if not fut.done():
                fut.cancel()
                error = f"the grammar did not compile within {self.config.grammar_compile_timeout:g}s"
            elif fut.exception() is not None:
                error = f"the grammar did not compile: {fut.exception()}"
            if error is None:
                compiled = fut.result()
                for seq in seqs:
                    seq.grammar = self.grammars.matcher(compiled)
                self.scheduler.add(seqs[0], seqs[1:])
                continue
            log.info("request %s refused: %s", seqs[0].request_id, error)
            for seq in seqs:
                seq.status, seq.finish_reason, seq.finish_time, seq.error = FINISHED, "error", time.time(), error
                self._remember(seq)
                out.append(self.delta(seq, []))
        self._compiling = keep
        return out

    def _masks(self, plan) -> None:
        """The allowed-token bitmasks of the constrained sequences that sample in this step."""
        seqs = self.scheduler.seqs
        todo = [(s.seq_id, seqs[s.seq_id].grammar) for s in plan.scheduled
                if seqs[s.seq_id].grammar is not None
                and seqs[s.seq_id].num_computed + s.num_tokens >= seqs[s.seq_id].num_tokens]
        if todo:
            plan.mask_seq_ids = [sid for sid, _ in todo]
            plan.masks = self.grammars.bitmask([m for _, m in todo])

    def _advance_grammar(self, seq: Sequence, tok: int | None) -> None:
        if not seq.finish_reason and tok is not None:
            if not seq.grammar.accept_token(tok):  # only when another rule banned every allowed token
                seq.error = "the output could not continue within its grammar (min_tokens or a ban conflicts with it)"
                self.scheduler.abort(seq.seq_id, "error")
            elif seq.grammar.is_terminated():  # the grammar is complete: the generation ends here
                self.scheduler.abort(seq.seq_id, "stop")
        if seq.finish_reason:
            seq.grammar = None

    def num_cached_tokens(self, seq_id: int) -> int:
        seq = self.scheduler.seqs.get(seq_id)
        return (seq.num_cached_tokens or 0) if seq is not None else self.finished.get(seq_id, 0)

    # ---- the step ----
    def step(self) -> list[Delta]:
        """One step: a Delta (without text) for every sequence that moved, in batch order."""
        out = [self.delta(s, []) for s in self._zero] + self._expire()
        self._zero = []
        if self._compiling:
            out += self._admit_compiled()
        plan, self._pending = self._pending, None
        if plan is None and not self.scheduler.has_work():
            return out
        ahead = None
        try:
            if plan is None:
                plan = self.scheduler.schedule()
                self._masks(plan)
                self.runner.submit(plan)
            if self.config.overlap_schedule == "on" and self.scheduler.can_schedule_ahead():
                ahead = self.scheduler.schedule(ahead=True)
                if ahead.scheduled or ahead.new_seqs or ahead.dropped:
                    self._masks(ahead)
                    self.runner.submit(ahead)
                else:
                    self.scheduler.cancel(ahead)
                    ahead = None
            result = self.runner.collect()
        except WorkerDied as e:
            self.recover(e)
            return out + self._strike(plan, f"the model worker died running it ({e})")
        if result.error is not None:  # the worker lives on; its batch is gone: recompute everything
            if ahead is not None:
                try:
                    self.runner.collect()  # the step sent ahead failed too, on a batch that was gone
                except WorkerDied as e:
                    self.recover(e)
            self.scheduler.reset_worker_state()
            return out + self._strike(plan, f"the model step failed ({result.error})")
        self._pending = ahead
        for seq, toks in self.scheduler.update(result):
            if seq.grammar is not None:  # a constrained sequence never speculates: one token
                self._advance_grammar(seq, toks[0] if toks else None)
            toks = toks or []
            self.num_generation_tokens += len(toks)
            if len(seq.output_ids) <= 1 and (toks or seq.finish_reason):
                self.num_prompt_tokens += len(seq.prompt_ids)
                self.num_cached_prompt_tokens += seq.num_cached_tokens or 0
            if seq.finish_reason:
                self._remember(seq)
            out.append(self.delta(seq, toks))
        if self.scheduler.spec_method is not None:
            self._log_spec()
        return out

    def _log_spec(self, every: float = 10.0) -> None:
        s, (t, steps, drafts, accepted) = self.scheduler, self._spec_logged
        now = time.monotonic()
        if now - t < every or s.num_spec_steps == steps:
            return
        n = s.num_spec_steps - steps
        log.info("spec: accepted %.1f/%.1f per step (%d%% of %d drafts)", (s.num_accepted_tokens - accepted) / n,
                 (s.num_draft_tokens - drafts) / n,
                 100 * (s.num_accepted_tokens - accepted) // max(1, s.num_draft_tokens - drafts),
                 s.num_draft_tokens - drafts)
        self._spec_logged = (now, s.num_spec_steps, s.num_draft_tokens, s.num_accepted_tokens)

    def delta(self, seq: Sequence, toks: list[int]) -> Delta:
        """What `seq` adds with its new tokens `toks` (its whole output so far, for a resend)."""
        d = Delta(seq.seq_id, seq.request_id, seq.index, toks, "", seq.finish_reason, error=seq.error,
                  embedding=seq.embedding if seq.finish_reason else b"")
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
        self.finished[seq.seq_id] = seq.num_cached_tokens or 0
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
            self._pending = None
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
                     self.runner.restarts, [(c, n, t) for c, (n, t) in self.restart_budget.seconds.items()],
                     s.num_draft_tokens, s.num_accepted_tokens, self.blocks.num_blocks * self.config.block_size)

    def close(self) -> None:
        self.grammars.close()
        self.runner.close()

"""The offline Engine: the scheduler, one model worker and detokenization wired in one process."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Iterator

from xinfer.config import EngineConfig
from xinfer.detokenizer import IncrementalDetokenizer
from xinfer.errors import InvalidRequestError
from xinfer.kv_cache import BlockManager
from xinfer.loader import load_model_info
from xinfer.sampling_params import SEED_MASK, SamplingParams
from xinfer.scheduler import FINISHED, Scheduler, Sequence
from xinfer.workers.model_runner import ModelRunner, num_kv_blocks
from xinfer.workers.worker import RestartBudget, WorkerDied

log = logging.getLogger("xinfer.engine")


@dataclass
class RequestOutput:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list | None = None  # per token: (logprob, [(token id, logprob), ...])
    prompt_logprobs: list | None = None  # per prompt token: None for the first, then as logprobs
    queued_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None


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


class Engine:
    def __init__(self, config: EngineConfig | None = None, worker: str = "inproc", log_level: str = "info",
                 detokenize: bool = True, **kwargs):
        """worker="inproc" runs the model in this process (offline use, tests); "process" runs it
        in a worker process over shared-memory rings, restarted by recompute if it dies."""
        self.config = config = config or EngineConfig(**kwargs)
        self.info = load_model_info(config.model, config.load_format)
        config.resolve_quantization(self.info.kind == "gguf" and self.info.gguf.quantized)
        self.tokenizer = self.info.tokenizer
        self.detokenize = detokenize  # False when a detokenizer process does it (serving)
        ctx = self.info.config.get("max_position_embeddings") or 4096
        if config.max_model_len is None:
            config.max_model_len = min(ctx, 4096)
        self.max_model_len = config.max_model_len
        dtype = config.torch_dtype
        import torch
        blocks = config.num_kv_blocks or num_kv_blocks(config, self.info.config, dtype, torch.device(config.device))
        if worker == "process":
            from xinfer.ipc.channels import runtime_dir
            from xinfer.workers.worker import ProcessRunner
            self._rundir = runtime_dir()
            self.runner = ProcessRunner(config, blocks, self._rundir, log_level)
        else:
            self.runner = ModelRunner(config, self.info, blocks)
        self.blocks = BlockManager(blocks, config.block_size, config.enable_prefix_cache,
                                   config.prefix_cache_max_tokens)
        self.vocab_size = self.info.config["vocab_size"]
        self.scheduler = Scheduler(config, self.blocks, self.max_model_len, self.info.eos_token_ids)
        self._ids = itertools.count()
        self._detok: dict[int, IncrementalDetokenizer] = {}
        self._meta: dict[int, tuple[int, str]] = {}  # seq id -> (choice index, request id)
        self._cached: dict[int, int] = {}
        self._zero: list[Sequence] = []  # max_tokens=0 requests: finished without running
        self.num_prompt_tokens = self.num_generation_tokens = self.num_cached_prompt_tokens = 0
        self.default_params = default_sampling_params(self.info.generation_config)
        self.restart_budget = RestartBudget(config.max_restarts, config.restart_window)

    # ---- requests ----
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> list[int]:
        """Validate and queue one request; returns the seq ids of its n choices."""
        params = (params or self.default_params).validate(self.vocab_size)
        ids = self._prompt_ids(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if room < 1 or max_tokens > room:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                f"({self.max_model_len})")
        need = -(-(len(ids) + max_tokens) // self.config.block_size)
        if need > self.blocks.num_blocks:
            raise InvalidRequestError(f"request needs {need} KV blocks but the cache holds "
                                      f"{self.blocks.num_blocks}; raise --kv-cache-gb or shorten it")
        rid = request_id or f"req-{next(self._ids)}"
        seqs = []
        for i in range(params.n):
            seed = None if params.seed is None else (params.seed + i) & SEED_MASK
            seq = Sequence(next(self._ids), rid, list(ids), params, seed, max_tokens)
            seqs.append(seq)
            self._meta[seq.seq_id] = (i, rid)
            if self.tokenizer is not None and self.detokenize:
                self._detok[seq.seq_id] = IncrementalDetokenizer(self.tokenizer, ids, params.stop,
                                                                  params.skip_special_tokens)
        if max_tokens == 0 and params.prompt_logprobs is None:
            for s in seqs:
                s.status, s.finish_reason, s.finish_time = FINISHED, "length", time.time()
            self._zero.extend(seqs)
        else:
            self.scheduler.add(seqs[0], seqs[1:])
        return [s.seq_id for s in seqs]

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"unknown token id {bad[0]} (vocabulary size {self.vocab_size})")
        return ids

    def abort(self, seq_id: int) -> None:
        self.scheduler.abort(seq_id)
        self._forget(seq_id)

    def abort_request(self, request_id: str) -> None:
        """Abort every choice of a request (a client went away); frees their KV blocks now."""
        for sid in [sid for sid, (_, rid) in self._meta.items() if rid == request_id]:
            self.abort(sid)

    def _forget(self, seq_id: int) -> None:
        self._detok.pop(seq_id, None)
        self._meta.pop(seq_id, None)

    # ---- the loop ----
    def step(self) -> list[Delta]:
        """Run one scheduler step; returns the deltas it produced."""
        deltas = [self._delta(s, [], s.finish_reason) for s in self._zero]
        for s in self._zero:
            self._forget(s.seq_id)
        self._zero = []
        if not self.scheduler.has_work():
            return deltas
        plan = self.scheduler.schedule()
        try:
            result = self.runner.execute(plan)
        except WorkerDied as e:
            self._recover(e)
            return deltas
        for seq, tok in self.scheduler.update(result):
            reason = seq.finish_reason
            text = ""
            toks = [] if tok is None else [tok]
            det = self._detok.get(seq.seq_id)
            if det is not None:
                text = det.add(toks)
                if det.stopped is not None and reason is None:
                    self.scheduler.abort(seq.seq_id, "stop")  # the detokenizer found a stop string
                    reason = "stop"
                if reason:
                    text += det.flush()
            d = Delta(seq.seq_id, seq.request_id, self._meta[seq.seq_id][0], toks, text, reason)
            if seq.params.logprobs is not None and toks:
                d.logprobs = seq.logprobs[-1:]
            if seq.params.prompt_logprobs is not None and len(seq.output_ids) <= 1:
                d.prompt_logprobs = [None] + seq.prompt_logprobs
            if reason and seq.scheduled_time is not None:
                d.queue_time = max(0.0, seq.scheduled_time - seq.arrival_time)
            deltas.append(d)
            self.num_generation_tokens += len(toks)
            if len(seq.output_ids) <= 1 and (toks or reason):
                self.num_prompt_tokens += len(seq.prompt_ids)
                self.num_cached_prompt_tokens += seq.num_cached_tokens or 0
            if reason:
                self._cached[seq.seq_id] = seq.num_cached_tokens or 0
                if len(self._cached) > 4096:  # bounded: a server runs forever
                    self._cached.pop(next(iter(self._cached)))
                self._forget(seq.seq_id)
        return deltas

    def _recover(self, err: Exception) -> None:
        """A worker died: start a new one and recompute every running sequence from its tokens.
        Clients see a slower response, not an error; greedy outputs are unchanged."""
        while True:  # a worker that dies while it starts counts as one more restart
            self.restart_budget.record("xinfer::worker-0", str(err))
            log.warning("model worker died (%s); restarting it and recomputing %d sequences", err,
                        len(self.scheduler.running))
            self.scheduler.reset_worker_state()
            try:
                self.runner.restart()
                return
            except WorkerDied as e:
                err = e

    def check_worker(self) -> None:
        """Restart a worker process that died while the engine was idle (before a request needs it)."""
        proc = getattr(self.runner, "proc", None)
        if proc is not None and not proc.is_alive():
            self._recover(WorkerDied(f"exit code {proc.exitcode}"))

    def close(self) -> None:
        if hasattr(self.runner, "close"):
            self.runner.close()
        if hasattr(self, "_rundir"):
            import shutil
            shutil.rmtree(self._rundir, ignore_errors=True)

    def _delta(self, seq, toks, reason):
        return Delta(seq.seq_id, seq.request_id, self._meta[seq.seq_id][0], toks, "", reason)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._zero)

    def get_num_cached_tokens_for_seq(self, seq_id: int) -> int:
        seq = self.scheduler.seqs.get(seq_id)
        if seq is not None:
            return seq.num_cached_tokens or 0
        return self._cached.get(seq_id, 0)

    # ---- offline API ----
    def stream(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> Iterator[Delta]:
        """Queue prompts and yield deltas as they are produced, until all finish."""
        for p, sp in zip(prompts, self._params_list(params, len(prompts))):
            self.add_request(p, sp)
        while self.has_unfinished():
            yield from self.step()

    def generate(self, prompts, params=None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        order, outs = [], {}
        for p, sp in zip(prompts, self._params_list(params, len(prompts))):
            for sid in self.add_request(p, sp):
                order.append(sid)
                outs[sid] = None
        seqs = {}
        for sid in order:
            seqs[sid] = self.scheduler.seqs.get(sid) or next(s for s in self._zero if s.seq_id == sid)
        texts = {sid: [] for sid in order}
        while self.has_unfinished():
            for d in self.step():
                if d.seq_id in texts:
                    texts[d.seq_id].append(d.text)
        return [self._output(seqs[sid], "".join(texts[sid])) for sid in order]

    def chat(self, conversations, params=None, **template_kwargs) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.encode_chat(c, **template_kwargs) for c in conversations]
        return self.generate(prompts, params)

    def _output(self, seq: Sequence, text: str) -> RequestOutput:
        return RequestOutput(seq.seq_id, seq.request_id, seq.prompt_ids, list(seq.output_ids), text,
                             seq.finish_reason, seq.num_cached_tokens or 0,
                             seq.logprobs if seq.params.logprobs is not None else None,
                             [None] + seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
                             seq.arrival_time, seq.first_token_time, seq.finish_time)

    def _params_list(self, params, n):
        if isinstance(params, list):
            if len(params) != n:
                raise InvalidRequestError(f"{len(params)} sampling params for {n} prompts")
            return params
        return [params or self.default_params] * n


def default_sampling_params(generation_config: dict) -> SamplingParams:
    """The model's generation_config.json sets the defaults a request doesn't override."""
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    kwargs = {k: generation_config[k] for k in keys if generation_config.get(k) is not None}
    if generation_config.get("do_sample") is False:
        kwargs["temperature"] = 0.0
    if generation_config.get("max_new_tokens"):
        kwargs["max_tokens"] = generation_config["max_new_tokens"]
    return SamplingParams(**kwargs)

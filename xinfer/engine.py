"""The offline Engine: the engine core, its model runner and detokenization, in one process."""
from __future__ import annotations

import gc
import shutil
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from xinfer import parallel, spec
from xinfer.config import EngineConfig
from xinfer.detokenizer import IncrementalDetokenizer
from xinfer.engine_core import Delta, EngineCore
from xinfer.errors import InvalidRequestError
from xinfer.ipc.topology import Topology
from xinfer.loader import load_model_info
from xinfer.mm import processor_for
from xinfer.mm.base import PromptImageError
from xinfer.mm.chat import chat_prompt
from xinfer.process import freeze_heap
from xinfer.sampling_params import SamplingParams, check_request, embedding_params, tokenize_bad_words
from xinfer.scheduler import Sequence
from xinfer.structured import check as check_structured
from xinfer.workers.model_runner import ModelRunner
from xinfer.workers.worker import ProcessRunner


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
    prompt_logprobs: list | None = None  # per prompt token: None for the first, then as logprobs + its rank
    queued_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    error: str | None = None  # with finish_reason "error": why the request could not be run


class Engine:
    """The offline engine: an EngineCore (xinfer/engine_core.py) with its runner in this process or
    in a worker process, plus detokenization; what `xinfer generate` and the tests use."""

    def __init__(self, config: EngineConfig | None = None, worker: str = "inproc", log_level: str = "info",
                 **kwargs):
        """worker="inproc" runs the model in this process; "process" runs it in a worker process over
        shared-memory rings, restarted by recompute if it dies."""
        self.config = config = config or EngineConfig(**kwargs)
        self.info = info = load_model_info(config.model, config.load_format, config.read_chat_template())
        config.resolve(info.config)
        config.resolve_quantization(info.has_blocks)
        spec.check(config, info)
        parallel.check(config, info.config)
        self.tokenizer = info.tokenizer
        self.vision = processor_for(info.config, info.tokenizer)  # a vision model's image processor, else None
        self.vocab_size = info.config["vocab_size"]
        if worker == "process" or config.tensor_parallel_size * config.pipeline_parallel_size > 1:  # a process a rank
            topology = Topology.create()
            self._rundir = topology.rundir
            runner = ProcessRunner(config, topology, log_level)
        else:
            self._rundir = None
            runner = ModelRunner(config, info)
        self.core = EngineCore(config, info, runner)
        self.max_model_len = self.core.max_model_len  # capped by the KV cache
        self._detok: dict[int, IncrementalDetokenizer] = {}  # the one per-choice state kept here
        self.default_params = default_sampling_params(info.generation_config)
        freeze_heap()

    # The core's parts, for callers that look inside (tests, benchmarks).
    runner = property(lambda self: self.core.runner)
    scheduler = property(lambda self: self.core.scheduler)
    blocks = property(lambda self: self.core.blocks)

    # ---- requests ----
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> list[int]:
        """Check and queue one request; returns the seq ids of its n choices."""
        return [s.seq_id for s in self._add(prompt, params, request_id)]

    def _add(self, prompt, params, request_id=None) -> list[Sequence]:
        params = params or self.default_params
        ids = self._prompt_ids(prompt)
        tokenize_bad_words(self.tokenizer, params)
        if params.structured is not None:
            check_structured(params.structured)
        check_request(ids, params, self.vocab_size, self.max_model_len, self.core.blocks.num_blocks,
                      self.config.block_size)
        seqs = self.core.add_request(request_id or f"req-{next(self.core._ids)}", ids, params,
                                     getattr(prompt, "images", None))
        if self.tokenizer is not None:
            for s in seqs:
                self._detok[s.seq_id] = IncrementalDetokenizer(self.tokenizer, ids, params.stop,
                                                               params.skip_special_tokens,
                                                               params.include_stop_str_in_output)
        return seqs

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def abort(self, seq_id: int) -> None:
        self.core.abort(seq_id)
        self._detok.pop(seq_id, None)

    def abort_request(self, request_id: str) -> None:
        """Abort every choice of a request; frees their KV blocks now."""
        for seq in [s for s in self.core.scheduler.seqs.values() if s.request_id == request_id]:
            self.abort(seq.seq_id)

    # ---- the loop ----
    def step(self) -> list[Delta]:
        """Run one core step; returns its deltas, with their text."""
        deltas = self.core.step()
        for d in deltas:
            det = self._detok.get(d.seq_id)
            if det is None:
                continue
            d.text = det.add(d.token_ids)
            if det.stopped is not None and d.finish_reason is None:
                self.core.abort(d.seq_id, "stop")  # the detokenizer found a stop string
                d.finish_reason = "stop"
            if d.finish_reason:
                d.text += det.flush()
                del self._detok[d.seq_id]
        return deltas

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def get_num_cached_tokens_for_seq(self, seq_id: int) -> int:
        return self.core.num_cached_tokens(seq_id)

    def close(self) -> None:
        self.core.close()
        if self._rundir is not None:
            shutil.rmtree(self._rundir, ignore_errors=True)
        gc.unfreeze()  # this engine's cycles collectable again (another engine's objects: scanned, not lost)

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
        seqs = {s.seq_id: s for p, sp in zip(prompts, self._params_list(params, len(prompts)))
                for s in self._add(p, sp)}
        order = list(seqs)
        texts = {sid: [] for sid in order}
        while self.has_unfinished():
            for d in self.step():
                if d.seq_id in texts:
                    texts[d.seq_id].append(d.text)
        return [self._output(seqs[sid], "".join(texts[sid])) for sid in order]

    def embed(self, prompts) -> list[list[float]]:
        """One L2-normalised vector per prompt (text or token ids): the final hidden states pooled as
        --pooling says, by the same prefill-only core path as /v1/embeddings."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        seqs = [s for p in prompts for s in self._add(p, embedding_params())]
        while self.has_unfinished():
            self.step()
        for s in seqs:
            if not s.embedding:
                raise InvalidRequestError(s.error or f"embedding {s.request_id} ended with {s.finish_reason}")
        return [np.frombuffer(s.embedding, dtype="<f4").tolist() for s in seqs]

    def chat(self, conversations, params=None, **template_kwargs) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        try:  # content parts may hold images (PIL, paths, data: URLs) for a vision model
            prompts = [chat_prompt(self.tokenizer, self.vision, c, **template_kwargs) for c in conversations]
        except PromptImageError as e:
            raise InvalidRequestError(str(e)) from None
        return self.generate(prompts, params)

    def _output(self, seq: Sequence, text: str) -> RequestOutput:
        return RequestOutput(seq.seq_id, seq.request_id, seq.prompt_ids, list(seq.output_ids), text,
                             seq.finish_reason, seq.num_cached_tokens or 0,
                             seq.logprobs if seq.params.logprobs is not None else None,
                             [None] + seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
                             seq.arrival_time, seq.first_token_time, seq.finish_time, seq.error)

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

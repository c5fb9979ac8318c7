"""The model worker's core: owns the model and its KV cache, keeps the persistent batch,
and turns each StepPlan into one forward pass and one batched sampling call."""
from __future__ import annotations

import collections
import dataclasses
import logging

import numpy as np
import torch

from ops import cpu_isa, cpu_kernels, qgemm
from ops.backends import get_backend
from ops.quant import QuantWeight
from ops.sampling import on_device, sample
from ops.speculative import verify
from xinfer import envs, hybrid, spec
from xinfer import parallel as tp
from xinfer.config import EngineConfig
from xinfer.ipc.step import StepPlan, StepResult, pack_ids, unpack_ids
from xinfer.loader import ModelInfo, load_model_info
from xinfer.loader.isq import apply_isq
from xinfer.loader.weights import bf16_held, build_model, gguf_held
from xinfer.models.layers import attach_blocks, attach_fast
from xinfer.workers import graphs, kv_memory, outputs, pipeline
from xinfer.workers.batch import WorkerSeq, drafted, forward, sampling_batch
from xinfer.workers.drafter import Drafter
from xinfer.workers.mm import VisionInputs
from xinfer.workers.mtp import MtpDrafter

log = logging.getLogger("xinfer.worker")


class ModelRunner:
    """The in-process Runner (xinfer/workers/runner.py); the worker process runs one too."""

    restarts = 0

    def __init__(self, config: EngineConfig, info: ModelInfo, num_blocks: int | None = None):
        """`num_blocks` None: as many KV blocks as the memory budget allows, measured now that
        the weights are loaded (on a GPU, free memory is only known here)."""
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        torch.manual_seed(config.seed)
        method = spec.method(config, info.config)
        cfg = dict(info.config, _max_positions=config.max_model_len, _mtp=method == "mtp")
        self.model = self._build(info, cfg)
        self.vocab_size = cfg["vocab_size"]
        self.eos_ids = info.eos_token_ids
        self.backend = get_backend(config.attention_backend, self.device)
        if self.device.type == "cpu":
            kinds = {type(getattr(m, "blocks", None)) for m in self.model.modules()}
            log.info(cpu_isa.describe(config.cpu_matmul, config.quantization == "gguf", cpu_kernels.has_bf16(),
                                      qgemm.PackedWeight in kinds, qgemm.Bf16Weight in kinds))
        self.block_size = config.block_size
        self.drafter, draft_cfg = None, None
        if method == "mtp":
            self.drafter = MtpDrafter(self.model, self.backend, self.device, self.block_size, self.vocab_size,
                                      self.eos_ids)
            draft_cfg = dict(cfg, num_hidden_layers=1)  # the head's one decoder layer
            log.info("the model's MTP head proposes %d tokens a step", config.num_speculative_tokens)
        if method == "draft":
            dinfo = load_model_info(config.draft_model)
            draft_cfg = dict(dinfo.config, _max_positions=config.max_model_len)
            self.drafter = Drafter(self._build(dinfo, draft_cfg), self.backend, self.device, self.block_size,
                                   self.vocab_size, self.eos_ids, config.prefill_chunk_size)
            log.info("draft model %s proposes %d tokens a step", dinfo.name, config.num_speculative_tokens)
        self.graph_why = graphs.why_not(config, self.model, self.backend, self.device)
        self.num_blocks = num_blocks or config.num_kv_blocks or self._kv_blocks(
            kv_memory.kv_block_bytes(config, cfg, self.dtype, draft_cfg))
        self.num_blocks = tp.world_min(self.num_blocks)  # each rank's free memory may differ
        kv_memory.alloc_kv(self.model, self.config, self.num_blocks, self.dtype, self.backend.name, self.device)
        if hasattr(self.model, "alloc_state"):  # hybrids: the linear-attention layers' recurrent state
            snaps = hybrid.num_snapshots(config)
            nbytes = self.model.alloc_state(config.max_num_seqs + snaps, self.device)
            log.info("recurrent-state pool: %d slots (--max-num-seqs) and %d prefix-cache snapshots, %.2f GiB",
                     config.max_num_seqs, snaps, nbytes / (1 << 30))
        if self.drafter is not None:
            # a draft model or the MTP head
            kv_memory.alloc_kv(self.drafter.model, self.config, self.num_blocks, self.dtype, self.backend.name, self.device)
        self.graphs = graphs.capture(self.model, self.backend, self.device, config) if self.graph_why is None else None
        if self.graph_why is not None and self.device.type == "cuda":
            log.info("decode steps run eagerly: %s", self.graph_why)
        self.seqs: dict[int, WorkerSeq] = {}
        self._sent: collections.deque[StepPlan] = collections.deque()
        self._inflight: collections.deque[pipeline.Launched] = collections.deque()
        self.early_launches = 0  # steps launched before the one before them was read back
        # launch a step before reading the last one's tokens (pipeline.py): on CUDA with overlap
        # scheduling, one rank, no draft model or MTP head, no images
        self.early_launch = (config.overlap_schedule == "on" and (self.device.type == "cuda" or envs.cpu_pipeline())
                             and tp.world_size() == 1 and self.drafter is None and not hasattr(self.model, "encode_images"))
        if config.kvcache_dtype.startswith("turbo"):
            kv_memory.calibrate_key_shift(self, info)
        # a vision-language model: images' positions, encoder runs and embeddings (xinfer/workers/mm.py)
        has_vision = hasattr(self.model, "encode_images")
        self.vision = VisionInputs(self.model, self.device) if has_vision else None

    def _build(self, info: ModelInfo, cfg: dict):
        """The model with its fast CPU weights: GGUF blocks (a quantized GGUF's own, or --isq's for
        a float checkpoint, when the target's --quantization settled on gguf) and, on a CPU, the packed
        weights of the bigger batches (layers.attach_fast)."""
        kernels = self.config.quantization == "gguf"
        # a quantized HF checkpoint's linears that the block kernels read as they are (without --isq)
        ckpt_blocks = [] if kernels and info.quant is not None and not self.config.isq else None
        gguf_blocks = kernels and info.kind == "gguf" and info.gguf.quantized
        # 8-bit activations as llama.cpp's: a fast path, so --cpu-matmul float32 keeps the exact blocks
        fast_blocks = self.device.type == "cpu" and tp.world_size() == 1 and qgemm.available() \
            and self.config.cpu_matmul != "float32"
        held = gguf_held(info.gguf) if gguf_blocks and fast_blocks else None
        if info.kind == "hf" and info.quant is None and not self.config.isq and self.device.type == "cpu" \
                and self.config.cpu_matmul == "bfloat16" and tp.world_size() == 1 and qgemm.Bf16Weight.available():
            held = bf16_held(info.path)
        model = build_model(dataclasses.replace(info, config=cfg), self.dtype, self.device, ckpt_blocks, held)
        if gguf_blocks:
            skip = getattr(model, "held_names", set())
            n = attach_blocks(model, ((name, QuantWeight.from_gguf(*b)) for name, *b in info.gguf.quantized_blocks(getattr(model, "keeps", None))
                                      if name not in skip), model.remap)
            log.info("GGUF blocks kept for %d more weights (the small batches read them)", n)
            info.gguf.drop_pages()  # every tensor is a copy by now: the mapping's pages need not count here
        elif self.config.isq and kernels:
            if info.kind == "gguf":
                log.info("--isq %s: %s is a GGUF file, its own tensor types stay", self.config.isq, info.name)
            else:
                apply_isq(model, self.config.isq, info.path if info.kind == "hf" else None, held=fast_blocks)
        elif ckpt_blocks:
            n = attach_blocks(model, ckpt_blocks, model.remap)
            log.info("%s: %d of %d quantized weights read in place by the block kernels (the small batches)",
                     info.quant.method, n, len(ckpt_blocks))
        if self.device.type == "cpu" and self.dtype == torch.float32:
            attach_fast(model, self.config.cpu_matmul)
        return model

    def _kv_blocks(self, per_block: int) -> int:
        """On a CPU, --kv-cache-gb; on a GPU, --kv-fraction of the memory free now that the weights
        are loaded, less the activations' peak at the largest step and the decode graphs' pool, each
        measured by a forward on a cache of just the blocks it needs."""
        if self.device.type != "cuda":
            return max(int(self.config.kv_cache_gb * (1 << 30) // per_block), 1)
        mem = graphs.CudaMemory(self.device)
        free = mem.free()
        prefill, decode = graphs.profile_rows(self.config, self.block_size)
        self.num_blocks = max(sum(len(b) for b, _, _ in r) for r in (prefill, decode))
        kv_memory.alloc_kv(self.model, self.config, self.num_blocks, self.dtype, self.backend.name, self.device,
                            quiet=True)
        sample = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        run = lambda rows: forward(self.model, self.backend, self.device, self.block_size, rows)
        # pipeline stages would wait on each other, a hybrid's forward on its state pool: not measured
        measured = tp.stages() == 1 and not hasattr(self.model, "alloc_state")
        act = graphs.profile(lambda: self.model.compute_logits(run(prefill)[-sample:]), mem) if measured else 0
        graph = graphs.profile(lambda: run(decode), mem) if self.graph_why is None else 0
        for layer in self.model.attention_layers():
            layer.k_cache = layer.v_cache = None
        torch.cuda.empty_cache()  # the temporary cache's memory back to the device, for the real one
        budget = graphs.kv_budget(free, act, graph, self.config.kv_fraction)
        log.info("device memory: %.2f GiB free after the weights, activations %.2f GiB, decode graphs %.2f GiB; "
                 "KV cache %.2f GiB (--kv-fraction %.2f)", free / (1 << 30), act / (1 << 30), graph / (1 << 30),
                 budget / (1 << 30), self.config.kv_fraction)
        return max(budget // per_block, 1)

    def restart(self) -> None:
        self.seqs.clear()  # in-process: nothing died; the recompute refills the batch
        self._sent.clear()
        self._inflight.clear()

    def submit(self, plan: StepPlan) -> None:
        self._sent.append(plan)  # in-process, a step runs when its result is asked for

    def collect(self) -> StepResult:
        """The oldest step's result; a step sent after it is launched first where it can be
        (xinfer/workers/pipeline.py)."""
        while self._sent and self.ready(self._sent[0]):
            self.start(self._sent.popleft())
        return self.finish()

    def dead(self) -> str | None:
        return None

    def close(self) -> None:
        pass

    # ---- the persistent batch ----
    def _apply(self, plan: StepPlan):
        for sid in plan.dropped:
            self.seqs.pop(sid, None)
        for ns in plan.new_seqs:
            self.seqs[ns.seq_id] = WorkerSeq(unpack_ids(ns.token_ids), ns.num_prompt_tokens, ns.num_computed,
                                             list(ns.block_ids), ns.params, ns.seed, state_slot=ns.state_slot)
            if ns.images and self.vision is not None:
                self.seqs[ns.seq_id].mm = self.vision.new_seq(ns.num_prompt_tokens, ns.images)
        for sid, snap in plan.state_restores:  # a prefix-cache hit: the state at its last block
            self.model.copy_state(snap, self.seqs[sid].state_slot)
        if plan.kv_copies:
            models = [self.model] + ([self.drafter.model] if self.drafter is not None else [])
            kv_memory.copy_slots(models, plan.kv_copies, self.block_size, self.device)
        for s in plan.scheduled:
            if s.new_block_ids:
                self.seqs[s.seq_id].block_ids.extend(s.new_block_ids)

    def execute(self, plan: StepPlan) -> StepResult:
        """One step, launched and finished; a step that raises (a bug, or input nothing caught
        before) clears the batch and says so in the result instead of taking the worker down."""
        self.start(plan)
        return self.finish()

    def in_flight(self) -> int:
        return len(self._inflight)

    def busy(self) -> bool:
        """Whether the device still runs the oldest step in flight (finishing it would wait)."""
        return bool(self._inflight) and self._inflight[0].tokens is not None and not self._inflight[0].tokens.done()

    def ready(self, plan: StepPlan | None) -> bool:
        """Whether `plan` can launch now: nothing in flight, or one step whose tokens `plan` can
        take on the device (pipeline.py)."""
        if not self._inflight:
            return True
        if not self.early_launch or len(self._inflight) > 1 or plan is None:
            return False
        return pipeline.can_follow(self._inflight[0], plan, self.seqs)

    @torch.inference_mode()
    def start(self, plan: StepPlan) -> None:
        """Launch `plan` (after those in flight): its forward and sampling are queued on the device."""
        try:
            step = self._launch(plan)
        except Exception as e:
            if tp.world_size() > 1:  # the other ranks may wait in a collective: the whole group restarts
                raise
            log.warning("step %d failed: %s: %s", plan.step_id, type(e).__name__, e)
            log.debug("step failure", exc_info=True)
            step = pipeline.Launched(plan, error=f"{type(e).__name__}: {e}")
        self.early_launches += bool(self._inflight)
        self._inflight.append(step)

    @torch.inference_mode()
    def finish(self) -> StepResult:
        """The oldest launched step's result, its tokens read back. A failed step clears the batch;
        a step launched after it fails with it."""
        step = self._inflight.popleft()
        if step.error is None:
            try:
                return self._finish(step)
            except Exception as e:
                if tp.world_size() > 1:
                    raise
                log.warning("step %d failed: %s: %s", step.plan.step_id, type(e).__name__, e)
                log.debug("step failure", exc_info=True)
                step.error = f"{type(e).__name__}: {e}"
        self.seqs.clear()
        for later in self._inflight:
            later.error = later.error or f"step {step.plan.step_id} before it failed ({step.error})"
        return StepResult(step.plan.step_id, [], b"", error=step.error)

    def _launch(self, plan: StepPlan) -> pipeline.Launched:
        self._apply(plan)
        step = pipeline.Launched(plan)
        if not plan.scheduled:
            return step
        drafts = {s.seq_id: unpack_ids(s.draft_ids) for s in plan.scheduled if s.num_spec and s.draft_ids}
        q = {}
        if self.drafter is not None and any(s.num_spec and not s.draft_ids for s in plan.scheduled):
            for sid, (d, qd) in self.drafter.propose(plan, self.seqs).items():
                drafts[sid], q[sid] = d, qd
        rows, sample_rows, sample_seqs, n = [], [], [], 0
        first_row = {}
        scored = []  # prompt logprobs asked: (seq id, first row, first scored position, count)
        pooled = []  # embedding sequences: (seq id, first row, first position, end)
        fix = pipeline.Fixups()  # input tokens the step in flight samples
        for s in plan.scheduled:
            ws = self.seqs[s.seq_id]
            step.seqs[s.seq_id] = ws
            start, end = ws.num_computed, ws.num_computed + s.num_tokens
            if ws.params.prompt_logprobs is not None and start < ws.num_prompt - 1:
                scored.append((s.seq_id, n, start + 1, min(end, ws.num_prompt - 1) - start))
            if ws.params.embed:
                pooled.append((s.seq_id, n, start, end))
            d = drafts.get(s.seq_id, [])
            fix.add(ws, start, end, n)
            rows.append((ws.block_ids, start, ws.tokens[start:end] + d))
            first_row[s.seq_id] = (n, start)
            n += s.num_tokens + len(d)
            if end == len(ws.tokens):  # caught up: this step yields the next token (and verifies drafts)
                sample_rows.extend(range(n - len(d) - 1, n))
                sample_seqs.append(s.seq_id)
        mm = {} if self.vision is None else {"mm": self.vision.inputs([self.seqs[s.seq_id] for s in plan.scheduled],
                                                                      rows)}
        if tp.stages() > 1:
            hidden = self._microbatched(rows)
        elif self.graphs is not None and self.graphs.fits(rows):
            hidden = self.graphs.run(rows, fix)
        else:
            hidden = forward(self.model, self.backend, self.device, self.block_size, rows,
                             [self.seqs[s.seq_id].state_slot for s in plan.scheduled],
                             hybrid.row_snapshots(plan, self.seqs), fix=fix, **mm)
        for s in plan.scheduled:
            self.seqs[s.seq_id].num_computed += s.num_tokens
        last = tp.last_stage()  # pipeline parallel: only the last stage has the final hidden states
        step.prompt_lps = outputs.prompt_logprobs(self.model, hidden, scored, self.seqs) if scored and last else []
        step.embeddings = outputs.pooled_embeddings(hidden, pooled, self.seqs, self.config.pooling) if pooled and last else []
        step.hidden, step.first_row, step.drafts, step.sample_seqs = hidden, first_row, drafts, sample_seqs
        if not sample_seqs:
            return step
        every_row = len(sample_rows) == len(hidden) if last else False  # a decode step: no gather
        logits = (self.model.compute_logits(hidden if every_row else hidden[on_device(sample_rows, torch.long,
                                                                                      self.device)])
                  if last else None)
        if tp.world_rank() == 0:
            self._sample(step, logits, q)
        return step

    def _finish(self, step: pipeline.Launched) -> StepResult:
        plan, sample_seqs, drafts = step.plan, step.sample_seqs, step.drafts
        if not sample_seqs:
            self._after_step(plan, step.hidden, step.first_row, {})
            return StepResult(plan.step_id, [], b"", [], step.prompt_lps, embeddings=step.embeddings)
        new, lps = self._sampled(step) if tp.world_rank() == 0 else ({}, {})
        if tp.world_size() > 1:  # rank 0 sampled: every rank's batch takes its tokens (one each: no drafts here)
            toks = tp.broadcast_tokens([new[sid][0] for sid in sample_seqs] if tp.world_rank() == 0 else [], len(sample_seqs))
            new = {sid: [t] for sid, t in zip(sample_seqs, toks)}
        for sid in sample_seqs:
            ws, toks = step.seqs[sid], new[sid]
            if sid in step.placeholders:  # where the launch left it (a later launch may have added another)
                ws.tokens[step.placeholders[sid]] = toks[0]
                if ws.pending is not None and ws.pending[1] is step.tokens:
                    ws.pending = None
            else:
                ws.tokens.extend(toks)
            if sid in drafts:  # the accepted drafts' KV is valid; the rejected ones' slots are given back
                ws.num_computed += len(toks) - 1
                ws.draft_computed = min(ws.draft_computed, ws.num_computed)
                del ws.block_ids[spec.blocks_needed(ws.num_computed, self.block_size):]
        self._after_step(plan, step.hidden, step.first_row, {sid: len(new[sid]) - 1 for sid in drafts})
        flat = [t for sid in sample_seqs for t in new[sid]]
        per_token = [e for sid in sample_seqs for e in lps.get(sid, [None] * len(new[sid]))] if lps else []
        return StepResult(plan.step_id, sample_seqs, pack_ids(flat), per_token, step.prompt_lps,
                          embeddings=step.embeddings, counts=[len(new[sid]) for sid in sample_seqs] if drafts else [])

    def _microbatched(self, rows):
        """Pipeline parallel: the step's sequences in up to --pipeline-parallel-size microbatches of
        about equal tokens, each through this stage's layers in turn, so that while the next stage
        works on one this stage works on the next. The last stage's hidden states, else None."""
        total, parts, acc = sum(len(r[2]) for r in rows), [[]], 0
        for r in rows:
            if parts[-1] and acc >= total * len(parts) / tp.stages():
                parts.append([])
            parts[-1].append(r)
            acc += len(r[2])
        out = [forward(self.model, self.backend, self.device, self.block_size, part) for part in parts]
        tp.wait_sends()
        return torch.cat(out) if tp.last_stage() else None

    def _after_step(self, plan, hidden, first_row, accepted):
        """Hand the MTP drafter the hidden states of the positions the target kept: each sequence's
        scheduled tokens and its accepted drafts."""
        if self.drafter is None or not self.drafter.follows_target:
            return
        kept = []
        for s in plan.scheduled:
            row, start = first_row[s.seq_id]
            kept.append((self.seqs[s.seq_id], start, hidden[row:row + s.num_tokens + accepted.get(s.seq_id, 0)]))
        self.drafter.after_step(kept)

    def _sample(self, step: pipeline.Launched, logits, q) -> None:
        """Queue the sampling of the step's rows (one per sequence, k + 1 for one with k drafts):
        the plain sequences' tokens stay on the device, each sequence's tokens end with a PENDING
        placeholder until the finish (pipeline.py); drafted sequences are verified now."""
        plan, sample_seqs, drafts = step.plan, step.sample_seqs, step.drafts
        plain = [sid for sid in sample_seqs if sid not in drafts]
        rows, r = {}, 0
        for sid in sample_seqs:
            rows[sid] = r
            r += 1 + len(drafts.get(sid, []))
        dev = self.device
        if plain:
            lg = logits if len(plain) == len(sample_seqs) else logits[on_device([rows[s] for s in plain], torch.long, dev)]
            batch = sampling_batch([self.seqs[i] for i in plain], self.vocab_size, self.eos_ids, dev)
            if plan.mask_seq_ids:
                row = {sid: i for i, sid in enumerate(plain)}
                words = torch.from_numpy(np.frombuffer(plan.masks, dtype=np.int32).reshape(len(plan.mask_seq_ids), -1).copy())
                batch.grammar = (torch.tensor([row[sid] for sid in plan.mask_seq_ids], device=dev), words.to(dev))
            tokens, step.logprobs = sample(lg, batch)
            step.plain, step.tokens = plain, pipeline.DeviceTokens(tokens)
            for i, sid in enumerate(plain):
                ws = self.seqs[sid]
                ws.tokens.append(pipeline.PENDING)
                ws.pending = (len(ws.tokens) - 1, step.tokens, i)
                step.placeholders[sid] = len(ws.tokens) - 1
        specs = [sid for sid in sample_seqs if sid in drafts]
        if specs:
            new, lps = {}, {}
            idx = [rows[sid] + j for sid in specs for j in range(1 + len(drafts[sid]))]
            lg = logits[on_device(idx, torch.long, dev)]
            views = [v for sid in specs for v in drafted(self.seqs[sid], drafts[sid])]
            batch = sampling_batch(views, self.vocab_size, self.eos_ids, dev)
            toks, lp = verify(lg, batch, [drafts[sid] for sid in specs], [q.get(sid) for sid in specs])
            new.update(zip(specs, toks))
            if lp is not None:
                per_token = [sid for sid, t in zip(specs, toks) for _ in t]
                entries = iter(outputs.token_logprobs(per_token, lp, self.seqs))
                lps.update((sid, [next(entries) for _ in t]) for sid, t in zip(specs, toks))
            step.spec = (new, lps)

    def _sampled(self, step: pipeline.Launched):
        """Each sampling sequence's new tokens ({seq id: [tokens]}) and, when asked, their logprobs
        ({seq id: [entry per token]}), read back from the device."""
        new, lps = dict(step.spec[0]), dict(step.spec[1])
        if step.plain:
            tokens = step.tokens.tolist()
            new.update((sid, [t]) for sid, t in zip(step.plain, tokens))
            if step.logprobs is not None:
                lps.update(zip(step.plain, ([e] for e in outputs.token_logprobs(step.plain, step.logprobs, step.seqs))))
        return new, lps

    @torch.inference_mode()
    def log_probs(self, ids: list[int], chunk: int = 512) -> torch.Tensor:
        """Teacher-forced next-token log-probabilities [len(ids), vocab] of one sequence, prefilled in
        chunks as a server would (xinfer-bench fidelity, tests). Uses the cache from block 0: only on a
        runner with no live sequences."""
        bs, n, dev = self.block_size, len(ids), self.device
        nb = -(-n // bs)
        if self.seqs or nb > self.num_blocks:
            raise ValueError(f"log_probs needs an idle runner with {nb} free KV blocks")
        blocks, out = list(range(nb)), []
        for start in range(0, n, chunk):
            hidden = forward(self.model, self.backend, dev, bs, [(blocks, start, ids[start:start + chunk])])
            out += [torch.log_softmax(self.model.compute_logits(h).float(), dim=-1) for h in hidden.split(128)]
        return torch.cat(out)

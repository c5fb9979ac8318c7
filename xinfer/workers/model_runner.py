"""The model worker's core: owns the model and its KV cache, keeps the persistent batch,
and turns each StepPlan into one forward pass and one batched sampling call."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import torch

from ops import cpu_isa
from ops.attention import AttnMetadata, get_backend, set_context
from ops.quant import max_rows
from ops.sampling import SamplingBatch, sample
from xinfer.config import EngineConfig
from xinfer.ipc.step import StepPlan, StepResult, pack_ids, unpack_ids
from xinfer.loader import ModelInfo
from xinfer.loader.weights import build_model
from xinfer.models.layers import attach_bf16, attach_blocks
from xinfer.sampling_params import SamplingParams

log = logging.getLogger("xinfer.worker")


@dataclass
class WorkerSeq:
    tokens: list[int]
    num_prompt: int
    num_computed: int
    block_ids: list[int]
    params: SamplingParams
    seed: int | None
    pool_sum: torch.Tensor | None = None  # params.embed with mean pooling: float32 sum of the rows so far


def kv_bytes_per_token(cfg: dict, dtype: torch.dtype) -> int:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


def num_kv_blocks(config: EngineConfig, cfg: dict, dtype: torch.dtype, device: torch.device) -> int:
    per_block = kv_bytes_per_token(cfg, dtype) * config.block_size
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * config.kv_fraction
    else:
        budget = config.kv_cache_gb * (1 << 30)
    return max(int(budget // per_block), 1)


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
        cfg = dict(info.config, _max_positions=config.max_model_len)
        self.model = build_model(dataclasses.replace(info, config=cfg), self.dtype, self.device)
        if config.quantization == "gguf":
            n = attach_blocks(self.model, info.gguf.quantized_blocks(), self.model.remap)
            log.info("GGUF blocks kept for %d weights (batches of up to %d rows read them)", n,
                     max_rows(config.cpu_matmul == "bfloat16"))
        self.vocab_size = cfg["vocab_size"]
        self.eos_ids = info.eos_token_ids
        self.backend = get_backend(config.attention_backend, self.device)
        if self.device.type == "cpu":
            if config.cpu_matmul == "bfloat16":
                attach_bf16(self.model)
            log.info(cpu_isa.describe(config.cpu_matmul, config.quantization == "gguf"))
        self.block_size = config.block_size
        self.num_blocks = num_blocks or config.num_kv_blocks or num_kv_blocks(config, cfg, self.dtype,
                                                                               self.device)
        self._alloc_kv(cfg)
        self.seqs: dict[int, WorkerSeq] = {}

    def _alloc_kv(self, cfg):
        layers = self.model.attention_layers()
        a = layers[0]
        shape = (self.num_blocks, self.block_size, a.num_kv_heads, a.head_dim)
        for layer in layers:
            layer.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        log.info("KV cache: %d blocks of %d tokens (%.2f GiB)", self.num_blocks, self.block_size,
                 2 * len(layers) * np.prod(shape) * layers[0].k_cache.element_size() / (1 << 30))

    def restart(self) -> None:
        self.seqs.clear()  # in-process: nothing died; the recompute refills the batch

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
                                             list(ns.block_ids), ns.params, ns.seed)
        for s in plan.scheduled:
            if s.new_block_ids:
                self.seqs[s.seq_id].block_ids.extend(s.new_block_ids)

    def execute(self, plan: StepPlan) -> StepResult:
        """One step; a step that raises (a bug, or input nothing caught before) clears the batch and
        says so in the result instead of taking the worker down."""
        try:
            return self._execute(plan)
        except Exception as e:
            log.warning("step %d failed: %s: %s", plan.step_id, type(e).__name__, e)
            log.debug("step failure", exc_info=True)
            set_context(None)
            self.seqs.clear()
            return StepResult(plan.step_id, [], b"", error=f"{type(e).__name__}: {e}")

    @torch.inference_mode()
    def _execute(self, plan: StepPlan) -> StepResult:
        self._apply(plan)
        if not plan.scheduled:
            return StepResult(plan.step_id, [], b"")
        bs = self.block_size
        ids, pos, slots, qlens, kvlens, tables, sample_rows, sample_seqs = [], [], [], [], [], [], [], []
        scored = []  # prompt logprobs asked: (seq id, first row, first scored position, count)
        pooled = []  # embedding sequences: (seq id, first row, first position, end)
        for s in plan.scheduled:
            ws = self.seqs[s.seq_id]
            start, end = ws.num_computed, ws.num_computed + s.num_tokens
            if ws.params.prompt_logprobs is not None and start < ws.num_prompt - 1:
                scored.append((s.seq_id, len(ids), start + 1, min(end, ws.num_prompt - 1) - start))
            if ws.params.embed:
                pooled.append((s.seq_id, len(ids), start, end))
            ids.extend(ws.tokens[start:end])
            p = np.arange(start, end)
            pos.append(p)
            blocks = np.asarray(ws.block_ids, dtype=np.int64)
            slots.append(blocks[p // bs] * bs + p % bs)
            qlens.append(s.num_tokens)
            kvlens.append(end)
            tables.append(ws.block_ids)
            if end == len(ws.tokens):  # caught up: this step yields the next token
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(s.seq_id)
        dev = self.device
        width = max(len(t) for t in tables)
        table = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            table[i, :len(t)] = t
        meta = AttnMetadata(
            cu_seqlens_q=torch.tensor(np.cumsum([0] + qlens), dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(kvlens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(table).to(dev),
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            query_lens=qlens, kv_lens=kvlens, block_size=bs)
        set_context(meta, self.backend)
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=dev),
                            torch.from_numpy(np.concatenate(pos)).to(dev))
        set_context(None)
        for s in plan.scheduled:
            self.seqs[s.seq_id].num_computed += s.num_tokens
        prompt_lps = self._prompt_logprobs(hidden, scored) if scored else []
        embeddings = self._pool(hidden, pooled) if pooled else []
        if not sample_seqs:
            return StepResult(plan.step_id, [], b"", [], prompt_lps, embeddings=embeddings)
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
        batch = self._sampling_batch([self.seqs[i] for i in sample_seqs])
        if plan.mask_seq_ids:
            row = {sid: i for i, sid in enumerate(sample_seqs)}
            words = torch.from_numpy(np.frombuffer(plan.masks, dtype=np.int32).reshape(len(plan.mask_seq_ids), -1).copy())
            batch.grammar = (torch.tensor([row[sid] for sid in plan.mask_seq_ids], device=dev), words.to(dev))
        tokens, lps = sample(logits, batch)
        tokens = tokens.tolist()
        for sid, t in zip(sample_seqs, tokens):
            self.seqs[sid].tokens.append(t)
        return StepResult(plan.step_id, sample_seqs, pack_ids(tokens), self._logprobs(sample_seqs, tokens, lps),
                          prompt_lps, embeddings=embeddings)

    def _pool(self, hidden, pooled) -> list[tuple[int, bytes]]:
        """Embedding sequences: --pooling over their prompt's final hidden states, which come in as
        many steps as the prefill has chunks (mean keeps a running float32 sum in the WorkerSeq; a
        recompute makes a new one). A prompt that ends this step gives its vector, L2-normalised."""
        out = []
        for sid, row, start, end in pooled:
            ws = self.seqs[sid]
            if self.config.pooling == "mean":  # the rows of this chunk's prompt tokens
                part = hidden[row:row + end - start].float().sum(0)
                ws.pool_sum = part if ws.pool_sum is None else ws.pool_sum + part
            if end < ws.num_prompt:
                continue
            mean = self.config.pooling == "mean"
            vec = ws.pool_sum / ws.num_prompt if mean else hidden[row + end - start - 1].float()
            vec = torch.nn.functional.normalize(vec, dim=0)
            out.append((sid, vec.cpu().numpy().astype("<f4").tobytes()))
        return out

    @torch.inference_mode()
    def log_probs(self, ids: list[int], chunk: int = 512) -> torch.Tensor:
        """Teacher-forced next-token log-probabilities [len(ids), vocab] of one sequence, prefilled in
        chunks as a server would (xinfer-bench fidelity, tests). Uses the cache from block 0: only on a
        runner with no live sequences."""
        bs, n, dev = self.block_size, len(ids), self.device
        nb = -(-n // bs)
        if self.seqs or nb > self.num_blocks:
            raise ValueError(f"log_probs needs an idle runner with {nb} free KV blocks")
        table = torch.arange(nb, dtype=torch.int32, device=dev)[None]
        out = []
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            pos = torch.arange(start, end, device=dev)
            set_context(AttnMetadata(
                cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32, device=dev),
                seq_lens=torch.tensor([end], dtype=torch.int32, device=dev), block_tables=table,
                slot_mapping=pos, query_lens=[end - start], kv_lens=[end], block_size=bs), self.backend)
            hidden = self.model(torch.tensor(ids[start:end], dtype=torch.long, device=dev), pos)
            set_context(None)
            out += [torch.log_softmax(self.model.compute_logits(h).float(), dim=-1) for h in hidden.split(128)]
        return torch.cat(out)

    def _prompt_logprobs(self, hidden, scored):
        """Logprobs of prompt tokens under the model's raw distribution (for echo / scoring):
        the row of position p scores the token at p + 1."""
        out = []
        for sid, row, first, count in scored:
            ws = self.seqs[sid]
            lp = torch.log_softmax(self.model.compute_logits(hidden[row:row + count]).float(), dim=-1)
            target = torch.tensor(ws.tokens[first:first + count], device=lp.device)
            chosen_t = lp.gather(1, target[:, None])
            ranks = (lp >= chosen_t).sum(-1).tolist()  # vLLM's rank: 1 + how many are more likely (ties count)
            chosen = chosen_t[:, 0].tolist()
            k = ws.params.prompt_logprobs
            if k:
                vals, idx = lp.topk(k, dim=-1)
                alts = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
            else:
                alts = [[] for _ in chosen]
            out.append((sid, first, list(zip(chosen, alts, ranks))))
        return out

    def _logprobs(self, seq_ids, tokens, lps):
        if lps is None:
            return []
        chosen, top_ids, top_vals = (x.tolist() if x is not None else None for x in lps)
        out = []
        for i, sid in enumerate(seq_ids):
            k = self.seqs[sid].params.logprobs
            if k is None:
                out.append(None)
            else:
                alts = list(zip(top_ids[i][:k], top_vals[i][:k])) if k and top_ids else []
                out.append((chosen[i], alts))
        return out

    def _sampling_batch(self, seqs: list[WorkerSeq]) -> SamplingBatch:
        dev, V = self.device, self.vocab_size
        ps = [s.params for s in seqs]

        def col(values, dtype=torch.float32, off=None):
            if off is not None and all(v == off for v in values):
                return None
            return torch.tensor(values, dtype=dtype, device=dev)

        def padded(lists):
            width = max(1, max(len(x) for x in lists))
            arr = np.full((len(lists), width), V, dtype=np.int64)
            for i, x in enumerate(lists):
                arr[i, :len(x)] = x
            return torch.from_numpy(arr).to(dev)

        outputs = [s.tokens[s.num_prompt:] for s in seqs]
        rep = col([p.repetition_penalty for p in ps], off=1.0)
        pres = col([p.presence_penalty for p in ps], off=0.0)
        freq = col([p.frequency_penalty for p in ps], off=0.0)
        bias_rows, bias_ids, bias_vals, ban_rows, ban_ids, seeds = [], [], [], [], [], []
        ok_rows, ok_ids = [], []
        for i, (s, p, out) in enumerate(zip(seqs, ps, outputs)):
            for tid, v in (p.logit_bias or {}).items():
                bias_rows.append(i), bias_ids.append(int(tid)), bias_vals.append(float(v))
            if len(out) < p.min_tokens:
                for tid in set(([] if p.ignore_eos else self.eos_ids) + list(p.stop_token_ids)):
                    ban_rows.append(i), ban_ids.append(tid)
            for bad in p.bad_words_ids:  # its last token, where the output ends with the rest of it
                if len(bad) == 1 or out[len(out) - len(bad) + 1:] == bad[:-1]:
                    ban_rows.append(i), ban_ids.append(bad[-1])
            if p.allowed_token_ids:
                ok_rows.extend([i] * len(p.allowed_token_ids)), ok_ids.extend(p.allowed_token_ids)
            if s.seed is not None:
                # the noise for output position k depends only on (seed, k)
                seeds.append((i, s.seed * 1_000_003 + len(out)))
        top_k = [min(p.top_k, V) if p.top_k > 0 else V for p in ps]
        return SamplingBatch(
            temperature=torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=dev),
            top_k=col(top_k, torch.long, off=V), top_p=col([p.top_p for p in ps], off=1.0),
            min_p=col([p.min_p for p in ps], off=0.0),
            repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq,
            output_ids=padded(outputs) if (rep is not None or pres is not None or freq is not None) else None,
            prompt_ids=padded([s.tokens[:s.num_prompt] for s in seqs]) if rep is not None else None,
            bias=(torch.tensor(bias_rows, device=dev), torch.tensor(bias_ids, device=dev),
                  torch.tensor(bias_vals, device=dev)) if bias_rows else None,
            banned=(torch.tensor(ban_rows, device=dev), torch.tensor(ban_ids, device=dev)) if ban_rows else None,
            allowed=(torch.tensor(ok_rows, device=dev), torch.tensor(ok_ids, device=dev)) if ok_rows else None,
            seeds=seeds, all_greedy=all(p.greedy for p in ps),
            num_logprobs=max((p.logprobs for p in ps if p.logprobs is not None), default=None))

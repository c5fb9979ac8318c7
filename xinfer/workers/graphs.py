"""CUDA graphs for decode steps, and the memory they and the activations take.

A step whose every sequence decodes one token replays a graph captured at start-up for the
smallest bucket that holds the batch (1, 2, 4, 8, then every 8: vLLM's sizes) instead of
launching each kernel from Python. A graph reads only static buffers (token ids, positions,
slot mapping, KV lengths, block tables): a step writes its rows into host mirrors (pinned on a
GPU), copies them over without blocking and replays. Padding rows write no KV (slot -1) and
read one cache entry (length 1). Prefill, mixed and oversized steps run eagerly.

How a graph is captured sits behind a capturer: `CudaCapturer` records real graphs sharing one
memory pool; `Rerun`, the CPU stand-in (XINFER_CPU_GRAPHS=1), runs the captured closure again on
each replay, over the metadata made at capture time, so everything around the capture (buckets,
padding, buffer updates, output slices) is tested without a GPU: a replay that read anything
but the static buffers would differ from the eager step. What the stand-in cannot show, a tensor
freed after capture that a real graph still reads, tests/test_graphs.py checks by ownership.
"""
from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch

from ops.attention import AttnMetadata, set_context
from xinfer import envs
from xinfer.workers.batch import block_table

log = logging.getLogger("xinfer.graphs")
GiB = 1 << 30
MAX_CAPTURE = 512  # the largest batch captured (vLLM's default cap); larger decode batches run eagerly


def buckets(max_bs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, 16, 24, ... below max_bs, and max_bs."""
    return [b for b in (1, 2, 4) if b < max_bs] + list(range(8, max_bs, 8)) + [max_bs]


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds n rows; None: more rows than any graph."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def why_not(config, model, backend, device) -> str | None:
    """Why this runner's decode steps cannot run as graphs, or None when they can."""
    if config.enforce_eager:
        return "--enforce-eager"
    if device.type != "cuda" and not envs.cpu_graphs():
        return "not on a CUDA device"
    if backend.name != "triton":  # its kernels read every per-step value from device tensors
        return f"the {backend.name} attention backend plans on the host each step (graphs need triton)"
    if not getattr(model, "cuda_graphs", False) or hasattr(model, "encode_images") or hasattr(model, "alloc_state"):
        return f"{type(model).__name__} has data-dependent shapes (experts, recurrent state or images)"
    if config.num_speculative_tokens and config.speculative_method in ("draft", "mtp"):
        return "a draft model or MTP head reads the target's hidden states"
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        return "tensor or pipeline parallel"
    if config.kvcache_dtype.startswith("turbo"):
        return "turbo KV caches are stored by torch with data-dependent shapes"
    return None


class CudaCapturer:
    """Real CUDA graphs; all share one memory pool (captured largest first, the smaller ones fit
    in what the larger left)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def capture(self, fn):
        # one eager run first: Triton compiles and cuBLAS sets up outside the graph
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = fn()
        return graph.replay, out


class Rerun:
    """The CPU stand-in: a replay runs the closure again and writes into the captured output, as a
    graph would."""

    def capture(self, fn):
        out = fn()
        return (lambda: out.copy_(fn())), out


class DecodeGraphs:
    """The captured decode forwards of one model, and the static buffers they read."""

    def __init__(self, model, backend, device: torch.device, block_size: int, max_bs: int, max_blocks: int,
                 capturer):
        self.sizes = buckets(min(max_bs, MAX_CAPTURE))
        self.block_size, self.width = block_size, max_blocks
        n, pin = self.sizes[-1], device.type == "cuda"
        self.pinned = pin

        def host(fill, dtype, *shape):
            return torch.full(shape or (n,), fill, dtype=dtype, pin_memory=pin)

        def buffers():
            return {"ids": host(0, torch.long), "pos": host(0, torch.long), "slots": host(-1, torch.long),
                    "lens": host(1, torch.int32), "tables": host(0, torch.int32, n, max_blocks)}
        # two sets of host mirrors, used in turn: with pipelined steps (pipeline.py) the next step
        # is written while the copy out of the last one's may still wait in the stream; an event
        # after each set's copies says when it is free again
        self.hosts = [buffers(), buffers()]
        self.views = [{k: v.numpy() for k, v in h.items()} for h in self.hosts]
        self.copied = [None, None]
        self.turn = 0
        self.dev = {k: v.to(device) for k, v in self.hosts[0].items()}
        # A graph holds raw pointers, not tensors: whatever it reads must live as long as it does.
        # (A local `cu` here was freed after capture and its memory reused: every replay read garbage
        # query offsets, seen on an H200.)
        self.cu = torch.arange(n + 1, dtype=torch.int32, device=device)
        d = self.dev
        self.graphs, self.metas = {}, {}
        self.replays = 0
        t0 = time.perf_counter()
        for b in reversed(self.sizes):
            # host lists are placeholders: the backend reads only the tensors (why_not)
            meta = self.metas[b] = AttnMetadata(
                cu_seqlens_q=self.cu[:b + 1], seq_lens=d["lens"][:b], block_tables=d["tables"][:b],
                slot_mapping=d["slots"][:b], query_lens=[1] * b, kv_lens=[1] * b, block_size=block_size)

            def fn(b=b, meta=meta):
                set_context(meta, backend)
                try:
                    return model(d["ids"][:b], d["pos"][:b])
                finally:
                    set_context(None)
            self.graphs[b] = capturer.capture(fn)
        log.info("decode graphs captured for batches %s in %.1f s", _span(self.sizes), time.perf_counter() - t0)

    def fits(self, rows) -> bool:
        return (len(rows) <= self.sizes[-1] and all(len(t) == 1 for _, _, t in rows)
                and max(len(b) for b, _, _ in rows) <= self.width)

    def run(self, rows: list[tuple[list[int], int, list[int]]], fix=None) -> torch.Tensor:
        """Hidden states [len(rows), H] of one decode token a row (block ids, position, [token])
        from the smallest graph that holds them; only rows that `fits`. `fix`: ids the step in
        flight is still sampling (pipeline.Fixups)."""
        k, n, bs = self.turn, len(rows), self.block_size
        self.turn = 1 - k
        if self.copied[k] is not None:
            self.copied[k].synchronize()
        host, v = self.hosts[k], self.views[k]
        b = bucket_for(n, self.sizes)
        pos = np.fromiter((start for _, start, _ in rows), dtype=np.int64, count=n)
        v["ids"][:n] = [t[0] for _, _, t in rows]
        v["ids"][n:b] = 0  # a padding row may hold a PENDING id (pipeline.py) from an earlier step
        v["pos"][:n] = pos
        block_table(rows, v["tables"])  # entries past a row's last block are never read
        v["slots"][:n] = v["tables"][np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs
        v["slots"][n:b] = -1
        v["lens"][:n] = pos + 1
        v["lens"][n:b] = 1
        for name, t in self.dev.items():  # non-blocking from pinned memory
            t[:b].copy_(host[name][:b], non_blocking=True)
        if self.pinned:
            self.copied[k] = torch.cuda.Event()
            self.copied[k].record(torch.cuda.current_stream(self.dev["ids"].device))
        if fix is not None:
            fix.apply(self.dev["ids"])
        replay, out = self.graphs[b]
        replay()
        self.replays += 1
        return out[:n]


def capture(model, backend, device: torch.device, config) -> DecodeGraphs:
    """A runner's decode graphs: real ones on CUDA, the stand-in elsewhere (XINFER_CPU_GRAPHS=1)."""
    width = -(-(config.max_model_len or model.cfg.get("_max_positions") or 4096) // config.block_size)
    return DecodeGraphs(model, backend, device, config.block_size, config.max_num_seqs, width,
                        CudaCapturer(device) if device.type == "cuda" else Rerun())


def _span(sizes: list[int]) -> str:
    return f"{sizes[0]}..{sizes[-1]} ({len(sizes)} sizes)"


def kv_budget(free: int, activations: int, graphs: int, fraction: float) -> int:
    """Bytes for the KV cache: `fraction` of the device memory free after the weights (`free`), less
    the activations' peak (a profiling forward at the largest token budget) and the graphs' pool."""
    left = free - activations - graphs
    if left <= 0:
        raise ValueError(f"no device memory left for the KV cache: {free / GiB:.2f} GiB free after the weights, "
                         f"activations take {activations / GiB:.2f} GiB and CUDA graphs {graphs / GiB:.2f} GiB; "
                         "lower --max-num-batched-tokens or --max-num-seqs, or pass --enforce-eager")
    return int(left * fraction)


class CudaMemory:
    """What `profile` reads of the device's memory."""

    def __init__(self, device: torch.device):
        self.device = device

    def free(self) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)[0]

    def start(self) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)


def profile_rows(config, block_size: int):
    """The largest step's rows (--max-num-batched-tokens in prefill chunks) and the largest decode
    graph's, as forward() takes them, each on blocks of its own from 0 (dummy token 0). A chunk is
    no longer than --max-model-len: positions past the model's rotary table read outside it (an
    illegal address on a GPU)."""
    prefill, nxt = [], 0
    chunk = min(config.prefill_chunk_size, config.max_model_len or config.prefill_chunk_size)
    for start in range(0, config.max_num_batched_tokens, chunk):
        n = min(chunk, config.max_num_batched_tokens - start)
        k = -(-n // block_size)
        prefill.append((list(range(nxt, nxt + k)), 0, [0] * n))
        nxt += k
    decode = [([i], 0, [0]) for i in range(buckets(min(config.max_num_seqs, MAX_CAPTURE))[-1])]
    return prefill, decode


def profile(run, memory) -> int:
    """The peak bytes `run()` allocates beyond what is held when it starts."""
    base = memory.start()
    run()
    return max(memory.peak() - base, 0)

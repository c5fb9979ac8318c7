"""Engine configuration: one dataclass, shared by the CLI, the offline Engine and the server."""
from __future__ import annotations

from dataclasses import dataclass, fields

from xinfer import envs

QUANTIZATIONS = ("auto", "none", "gguf")
DTYPES = ("float32", "bfloat16", "float16")
POOLINGS = ("last", "mean")
ISQ_FORMATS = ("q8_0", "q4_0", "q4_1", "q4_k", "q6_k")  # xinfer/loader/isq.py FORMATS
KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp8", "fp8_e4m3", "fp8_e5m2", "turbo8", "turbo4", "turbo3")


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def parse_cores(spec: str) -> list[int]:
    """"0-3,8" -> [0, 1, 2, 3, 8]; ValueError naming what does not parse."""
    out = []
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"--cpu-ranks-bind: {spec!r} is not a list of cores like 0-3,8")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


@dataclass
class EngineConfig:
    model: str | None = None  # folder, .gguf, HF cache id; None: the bundled SmolLM2-135M-Instruct
    load_format: str = "auto"  # "auto" or "dummy" (random weights; `model` names a config)
    dtype: str = "auto"  # float32 / bfloat16 / float16; auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    # gguf: a GGUF's quantized matrices (Q4_0, Q4_1, Q8_0) also stay as blocks, which small CPU
    # batches read through ops/cpu_kernels.c (exact weights, a fraction of the bytes); none: float
    # weights only. auto: gguf where it can run (CPU, float32, the kernels build), else none.
    quantization: str = "auto"
    # In-situ quantization of an HF float checkpoint: every linear's weight also as GGUF blocks in this
    # format (q8_0, q4_0, q4_1, q4_k, q6_k; the head in q8_0) for the CPU kernels, cached on disk (xinfer/loader/isq.py).
    isq: str | None = None
    # CPU GEMMs of batched decode and prefill: bfloat16 (oneDNN, on BF16 dot-product units) or float32.
    # auto: bfloat16 where the CPU has AVX512_BF16 or AMX and --dtype is auto, else float32; an explicit
    # --dtype float32 keeps every matmul float32 (exact against transformers).
    cpu_matmul: str = "auto"
    attention_backend: str = "auto"  # torch / triton / flashinfer / auto
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's context; the engine core caps it by the KV cache
    # tokens a step holds, and a prefill chunk's most; None: 2048 and 512 on a CPU (a step's time grows
    # with its tokens there), 8192 and 2048 on CUDA (launches cost the same at any size, so bigger steps
    # prefill faster: vLLM's 8192)
    max_num_batched_tokens: int | None = None
    prefill_chunk_size: int | None = None
    # resolved with the step sizes: a prompt's longest chunk when nothing else is running or waiting;
    # on a CPU with the chunk size left to auto the whole step (a lone 3,000-token prompt's first token
    # 7% sooner served), else the chunk size. Not a field: no flag of its own.
    prefill_chunk_alone = None
    block_size: int = 16
    kv_cache_gb: float = 1.0  # CPU KV cache size
    # How K/V are stored (ops/kv_quant.py): auto: the model dtype; bf16 / fp16: cast; fp8 (= fp8_e4m3),
    # fp8_e5m2: one byte a value with a float32 scale per token and head; turbo8/4/3: rotated vectors,
    # 8/4/3 bits a value and a length (ops/turbo_quant.py; torch and triton backends). The same --kv-cache-gb then
    # holds proportionally more tokens.
    kvcache_dtype: str = "auto"
    # GPU: share of the memory free after the weights, the activations' peak and the CUDA graphs for the KV cache
    kv_fraction: float = 0.85
    # on: plan and send the next step while this one runs (on the assumption that each sequence gets
    # its token), so the worker never waits for the scheduler; steps with drafts, grammars or a
    # recurrent state are planned after the previous one's result regardless. auto: on with CUDA (off
    # on a CPU, where a step dwarfs the scheduler's time: measured 1.00x at 16 clients, 0.97x at 64)
    overlap_schedule: str = "auto"
    enforce_eager: bool = False  # CUDA: no decode graphs (xinfer/workers/graphs.py); every step launches eagerly
    num_kv_blocks: int | None = None  # exact KV cache size in blocks (tests); overrides the two above
    enable_prefix_cache: bool = True
    prefix_cache_max_tokens: int | None = None  # cap on tokens kept for reuse; None: the whole cache
    # Hybrid (linear-attention) models: recurrent-state snapshots kept for prefix-cache hits to resume
    # from (xinfer/hybrid.py), each the size of one sequence's state; None: --max-num-seqs; 0: none
    # (prefix caching off for them)
    hybrid_state_snapshots: int | None = None
    # Tensor parallel (xinfer/parallel.py): worker processes (ranks) that each hold 1/N of every layer;
    # on a CPU each takes an even share of the cores, over gloo.
    tensor_parallel_size: int = 1
    # Pipeline parallel: the layers split in this many stages of tensor_parallel_size ranks each; a
    # step's sequences go through them in microbatches so the stages overlap.
    pipeline_parallel_size: int = 1
    devices: str | None = None  # CUDA devices of this node's ranks, "0,1" (xInfer's --d); None: 0, 1, ...
    cpu_ranks_bind: str | None = None  # this node's ranks' cores, "0-3|4-7"; None: an even share each
    # Several nodes (torch.distributed's TCP rendezvous at master_addr:master_port): node 0 runs the
    # API, the scheduler and world rank 0; the others run `xinfer serve --headless`, whose workers get
    # the step plans from node 0 over TCP (master_port + 1), signed with cluster_key.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    cluster_key: str | None = None
    startup_timeout: float = 600.0  # seconds for every rank (on every node) to load and join
    seed: int = 0
    max_restarts: int = 5  # child restarts (worker by recompute, detokenizer/parser) allowed ...
    restart_window: float = 300.0  # ... within this many seconds, before the engine gives up
    # A request still waiting for its first step after this many seconds is refused (retry later);
    # None: waits as long as it takes (offline batches). `xinfer serve` defaults to 120.
    max_queue_wait: float | None = None
    chat_template: str | None = None  # a Jinja file replacing (or supplying) the model's chat template
    grammar_compile_timeout: float = 30.0  # seconds a structured output's grammar may take to compile
    # /v1/embeddings: one vector per input from the final hidden states (after the last norm):
    # "last": the last prompt token's; "mean": the mean over every prompt token. L2-normalised.
    pooling: str = "last"
    # Speculative decoding (xinfer/spec.py): up to this many draft tokens a step, verified in one forward;
    # 0: off. method None: "draft" with a draft model, else "mtp" where the checkpoint has an MTP head
    # xinfer loads, else "ngram" (prompt lookup).
    num_speculative_tokens: int = 0
    speculative_method: str | None = None
    draft_model: str | None = None  # HF folder or GGUF with the target's tokenizer
    ngram_min: int = 2  # n-gram drafts: the shortest suffix looked up in the sequence
    ngram_max: int = 5
    # No drafts in a step whose running batch is larger than this: verification rows cost compute
    # that a large batch already uses (0: no limit)
    speculative_disable_by_batch_size: int = 4

    def read_chat_template(self) -> str | None:
        """--chat-template's text; a file that cannot be read is a start-up error naming it."""
        if self.chat_template is None:
            return None
        try:
            with open(self.chat_template, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {self.chat_template}: {e}") from None

    def __post_init__(self):
        if self.dtype not in DTYPES + ("auto",):
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)} or auto, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size", "block_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.device != "auto":
            self._step_sizes()
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.max_queue_wait is not None and not self.max_queue_wait > 0:
            raise ValueError(f"--max-queue-wait must be > 0 seconds, got {self.max_queue_wait}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"--grammar-compile-timeout must be > 0 seconds, got {self.grammar_compile_timeout}")
        if not self.restart_window > 0:
            raise ValueError(f"--restart-window must be > 0 seconds, got {self.restart_window}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization must be one of {list(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.kvcache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kvcache-dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kvcache_dtype!r}")
        self._check_isq()
        if self.pooling not in POOLINGS:
            raise ValueError(f"--pooling must be one of {list(POOLINGS)}, got {self.pooling!r}")
        if self.cpu_matmul not in ("auto", "float32", "bfloat16", "int16"):
            raise ValueError(f"--cpu-matmul must be auto, float32, bfloat16 or int16, got {self.cpu_matmul!r}")
        if not 0 < self.kv_fraction <= 1:
            raise ValueError(f"--kv-fraction must be in (0, 1], got {self.kv_fraction}")
        if self.overlap_schedule not in ("auto", "on", "off"):
            raise ValueError(f"--overlap-schedule must be auto, on or off, got {self.overlap_schedule!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"--load-format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.num_speculative_tokens == 0 and (self.draft_model or self.speculative_method):
            self.num_speculative_tokens = 4  # a draft model or method named alone turns speculation on
        if self.num_speculative_tokens < 0:
            raise ValueError(f"--num-speculative-tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.speculative_method not in (None, "ngram", "draft", "mtp"):
            raise ValueError(f"--speculative-method must be ngram, draft or mtp, got {self.speculative_method!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"--ngram-min / --ngram-max need 1 <= min <= max, got {self.ngram_min} / {self.ngram_max}")
        if self.speculative_disable_by_batch_size < 0:
            raise ValueError(f"--speculative-disable-by-batch-size must be >= 0, got {self.speculative_disable_by_batch_size}")
        self._check_parallel()
        self.read_chat_template()  # an unreadable file stops the start here, not in a child process

    def _check_parallel(self):
        if self.devices is not None:
            ids = self.device_ids()
            if self.tensor_parallel_size == 1 and self.pipeline_parallel_size == 1:
                self.tensor_parallel_size = len(ids) * self.nnodes  # --d 0,1 alone: one rank a device
        for flag in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            if getattr(self, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(self, flag)}")
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        if world % self.nnodes:
            raise ValueError(f"--nnodes {self.nnodes} must divide the {world} ranks (tensor x pipeline parallel)")
        local = world // self.nnodes
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        if self.devices is not None and len(self.device_ids()) != local:
            raise ValueError(f"--d {self.devices} names {len(self.device_ids())} devices for {local} ranks a node")
        if self.cpu_ranks_bind is not None:
            parts = self.cpu_ranks_bind.split("|")
            if len(parts) != local:
                raise ValueError(f"--cpu-ranks-bind {self.cpu_ranks_bind!r} has {len(parts)} entries for {local} ranks")
            for part in parts:
                parse_cores(part)
        if not 0 < self.master_port < 65535:
            raise ValueError(f"--master-port must be a TCP port below 65535, got {self.master_port}")
        if self.nnodes > 1 and not self.cluster_key and self.master_addr not in LOOPBACK:
            raise ValueError(f"--nnodes {self.nnodes} on {self.master_addr}: the step plans go over the network; "
                             "give every node the same --cluster-key (a shared secret) to sign them")
        if self.startup_timeout <= 0:
            raise ValueError(f"--startup-timeout must be > 0, got {self.startup_timeout}")

    def device_ids(self) -> list[int]:
        try:
            ids = [int(d) for d in str(self.devices).split(",")]
        except ValueError:
            raise ValueError(f"--d must list CUDA device numbers like 0,1, got {self.devices!r}") from None
        if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
            raise ValueError(f"--d must list distinct CUDA device numbers like 0,1, got {self.devices!r}")
        return ids

    def _check_isq(self):
        if self.isq is None:
            return
        self.isq = self.isq.lower()
        if self.isq not in ISQ_FORMATS:
            raise ValueError(f"--isq must be one of {list(ISQ_FORMATS)}, got {self.isq!r}")
        if self.quantization == "none":
            raise ValueError("--isq needs --quantization auto or gguf (none keeps float weights only)")

    def resolve(self, model_config: dict) -> "EngineConfig":
        """Settle what depends on the machine and the model (device and dtype "auto", the context
        length); idempotent. Only the processes that run the model call it: it imports torch."""
        if self.device == "auto":
            import torch
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.overlap_schedule == "auto":
            self.overlap_schedule = "on" if self.device.startswith("cuda") else "off"
        self._step_sizes()
        fast = self.dtype == "auto"
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        if self.cpu_matmul == "auto":
            from ops import cpu_isa
            cpu = self.device.startswith("cpu") and self.dtype == "float32"
            self.cpu_matmul = (envs.cpu_matmul() or cpu_isa.fast_matmul()) if cpu and fast else "float32"
            if self.cpu_matmul not in ("float32", "bfloat16", "int16"):
                raise ValueError(f"XINFER_CPU_MATMUL must be float32, bfloat16 or int16, got {self.cpu_matmul!r}")
            if self.kvcache_dtype == "auto" and self.cpu_matmul == "bfloat16":
                # the bfloat16 path's cache too: half the bytes each decode step's attention reads
                # (mean KLD 0.00005 against a float32 cache; bench/NOTES-cpu.md)
                self.kvcache_dtype = "bf16"
        return self.resolve_context(model_config)

    def _step_sizes(self) -> None:
        """The step's token budget and chunk size the device calls for, once it is known."""
        cuda = self.device.startswith("cuda")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 8192 if cuda else 2048
        if self.prefill_chunk_size is None:
            self.prefill_chunk_size = min(2048 if cuda else 512, self.max_num_batched_tokens)
            self.prefill_chunk_alone = self.prefill_chunk_size if cuda else self.max_num_batched_tokens

    def resolve_context(self, model_config: dict) -> "EngineConfig":
        """The max_model_len default, the one place it is computed (the API process needs it
        without torch): the model's context (4096 when its config does not say). The engine core
        lowers it to what the KV cache holds for one sequence (EngineCore.max_model_len)."""
        if self.max_model_len is None:
            self.max_model_len = model_config.get("max_position_embeddings") or 4096
        return self

    def resolve_quantization(self, has_blocks: bool) -> None:
        """Settle 'auto' once the checkpoint is known (`has_blocks`: weights the block kernels read,
        ModelInfo.has_blocks); an explicit gguf that cannot run is an error."""
        if self.quantization == "none":
            return
        from ops import cpu_kernels
        why = ("the model has no weights the block kernels read (a quantized GGUF, or a GPTQ, AWQ, WNA16, NVFP4 or "
               "MXFP4 checkpoint)" if not (has_blocks or self.isq)
               else "the kernels run on the CPU only" if not self.device.startswith("cpu")
               else f"the kernels compute in float32, not {self.dtype}" if self.dtype != "float32"
               else "the CPU kernels could not be built here (they need a C compiler and AVX-512 or AVX2)"
               if not cpu_kernels.available() else None)
        if why and (self.quantization == "gguf" or self.isq):
            raise ValueError(f"--{'isq ' + self.isq if self.isq else 'quantization gguf'}: {why}")
        self.quantization = "none" if why else "gguf"

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


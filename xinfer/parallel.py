"""Tensor and pipeline parallelism over torch.distributed (gloo on CPUs, NCCL on GPUs): a rank's
place in the group, how a dimension splits across ranks, and the collectives the layers call.

Each rank is a worker process (xinfer/workers/worker.py) that reads the same step plans and runs
the same forward over its share of every layer: attention heads and MLP columns split by
column-parallel projections, the output projections row-parallel with one all-reduce per attention
and per MLP block (xinfer/models/layers.py), routed experts split along their intermediate size,
the LM head split along the vocabulary and gathered. Rank 0 samples and sends the tokens to the
others, so every rank's persistent batch holds the same sequences.

Pipeline parallel splits the layers in stages of --tensor-parallel-size ranks each. World rank w is
TP rank w % tp of stage pp - 1 - w // tp: rank 0 holds the last stage (the norm, the head, the
sampling), so the rank that answers the scheduler is also the one with the logits, and it runs on
node 0. A step's sequences go through the stages in microbatches (xinfer/workers/model_runner.py):
stage s works on one while stage s + 1 works on the one before; activations (hidden state and
residual) travel point to point between the same TP rank of neighbouring stages.
"""
from __future__ import annotations

import datetime
import os

import torch

from xinfer.config import LOOPBACK, parse_cores
from xinfer.errors import ModelLoadError

_rank, _size = 0, 1  # within this rank's tensor-parallel group
_stage, _stages = 0, 1
_world = 0
_group = None  # this stage's tensor-parallel process group (None: the world, when there is one stage)
_device = torch.device("cpu")  # where collectives' own tensors live (NCCL takes CUDA tensors only)

# Families whose every projection goes through the shared Attention / GatedMLP / SparseMoe layers:
# what the layers shard. Kept without importing the models (the engine core checks at start-up).
TP_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                    "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
                    "Glm4ForCausalLM", "Glm4MoeForCausalLM")


def check(config, model_cfg: dict) -> None:
    """Start-up check: ModelLoadError naming why this engine can't run tensor parallel."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if config.node_rank:
        raise ModelLoadError(f"--node-rank {config.node_rank}: this runs node 0 (the API, the scheduler and rank 0); "
                             f"on node {config.node_rank} run `xinfer serve --headless` with the same --nnodes, "
                             "--master-addr, --master-port and --cluster-key")
    if tp * pp == 1:
        return
    flag = f"--tensor-parallel-size {tp}" + (f" --pipeline-parallel-size {pp}" if pp > 1 else "")
    why = None
    archs = model_cfg.get("architectures") or []
    heads, kv = model_cfg["num_attention_heads"], model_cfg.get("num_key_value_heads") or model_cfg["num_attention_heads"]
    if not any(a in TP_ARCHITECTURES for a in archs):
        why = f"{', '.join(archs) or 'this model'} is not sharded yet (tensor parallel runs {', '.join(TP_ARCHITECTURES)})"
    elif config.num_speculative_tokens:
        why = "speculative decoding does not run tensor or pipeline parallel yet"
    elif pp > model_cfg["num_hidden_layers"]:
        why = f"{model_cfg['num_hidden_layers']} layers do not make {pp} stages"
    elif kv < tp and (tp % kv or heads % tp):
        why = (f"{kv} KV heads are fewer than the ranks: replicating them needs the ranks to be a multiple of "
               f"them and the {heads} query heads to split evenly")
    if why:
        raise ModelLoadError(f"{flag}: {why}")


def init(world_rank: int, config, store: str, device: torch.device) -> None:
    """Join the group (a worker, before it builds the model): `store` is torch.distributed's
    init_method, a file in the runtime directory on one node, the master's TCP address across
    nodes. On a CPU, pin this rank to its cores (--cpu-ranks-bind, else an even share of this
    node's) so the ranks' thread pools don't compete; on a GPU, take its device."""
    global _rank, _size, _stage, _stages, _world, _group, _device
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    _world, _size, _stages = world_rank, tp, pp
    _rank, _stage = world_rank % tp, pp - 1 - world_rank // tp
    world = tp * pp
    if world == 1:
        return
    local = world_rank % (world // config.nnodes)  # this rank's place among its node's
    if device.type == "cpu":
        mine = bind_cores(config, local)
        os.sched_setaffinity(0, mine)
        torch.set_num_threads(len(mine))
    elif device.type == "cuda":
        _device = torch.device("cuda", config.device_ids()[local] if config.devices else local)
        torch.cuda.set_device(_device)
    if config.nnodes == 1 or config.master_addr in LOOPBACK:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=max(config.startup_timeout, 120))
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=store,
                                         rank=world_rank, world_size=world, timeout=timeout)
    if pp > 1 and tp > 1:  # every rank creates every stage's group, in the same order
        for s in range(pp):
            g = torch.distributed.new_group(list(range(s * tp, (s + 1) * tp)))
            if s == world_rank // tp:
                _group = g


def bind_cores(config, local: int) -> list[int]:
    """The cores of this node's rank `local`: its --cpu-ranks-bind entry ("0-3|4-7": one |-separated
    list a rank), else an even share of the cores this process may use."""
    if config.cpu_ranks_bind:
        return parse_cores(config.cpu_ranks_bind.split("|")[local])
    cores = sorted(os.sched_getaffinity(0))
    n = config.tensor_parallel_size * config.pipeline_parallel_size // config.nnodes
    per = max(1, len(cores) // n)
    return cores[local * per:(local + 1) * per] or cores[-per:]


def rank() -> int:
    return _rank


def size() -> int:
    return _size


def world_rank() -> int:
    return _world


def world_size() -> int:
    return _size * _stages


def stages() -> int:
    return _stages


def first_stage() -> bool:
    return _stage == 0


def last_stage() -> bool:
    """The stage with the norm and the head; world rank 0 (which samples and answers) is in it."""
    return _stage == _stages - 1


def layer_range(n: int) -> tuple[int, int]:
    """This stage's [start, end) of n layers, split as evenly as they go (earlier stages take the
    remainder: the last one also runs the head)."""
    per, extra = divmod(n, _stages)
    start = _stage * per + min(_stage, extra)
    return start, start + per + (_stage < extra)


def part(n: int) -> tuple[int, int]:
    """This rank's (start, count) of n units (KV heads, rows) split as evenly as they go (9 into 5
    and 4); with fewer units than ranks, each unit is replicated on size / n ranks (GQA's KV heads)."""
    if n >= _size:
        start = _rank * n // _size
        return start, (_rank + 1) * n // _size - start
    return _rank // (_size // n), 1


def head_parts(heads: int, kv_heads: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """This rank's (start, count) of the query heads and of the KV heads: the KV heads split, each
    with its group of query heads (so the split may be uneven); KV heads fewer than ranks are
    replicated and the query heads split evenly."""
    kv = part(kv_heads)
    if kv_heads >= _size:
        group = heads // kv_heads
        return (kv[0] * group, kv[1] * group), kv
    return part(heads), kv


def vocab_part(n: int) -> tuple[int, int, int]:
    """(start, count, per) of a vocabulary split in ceil(n / size) rows a rank (the last one shorter)."""
    per = -(-n // _size)
    start = min(_rank * per, n)
    return start, min(per, n - start), per


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _size > 1:
        torch.distributed.all_reduce(x, group=_group)
    return x


def world_min(n: int) -> int:
    """The smallest of every rank's n (the KV blocks each has room for: their caches must match)."""
    if world_size() == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64, device=_device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return int(t.item())


def gather_vocab(local: torch.Tensor, n: int) -> torch.Tensor:
    """Each rank's logits [T, count] -> every rank's [T, n]."""
    _, count, per = vocab_part(n)
    if count < per:
        local = torch.nn.functional.pad(local, (0, per - count))
    parts = [torch.empty_like(local) for _ in range(_size)]
    torch.distributed.all_gather(parts, local.contiguous(), group=_group)
    return torch.cat(parts, dim=-1)[:, :n]


def broadcast_tokens(tokens: list[int], count: int) -> list[int]:
    """Rank 0's `count` sampled tokens, on every rank."""
    if world_size() == 1:
        return tokens
    t = torch.tensor(tokens if _world == 0 else [0] * count, dtype=torch.int64, device=_device)
    torch.distributed.broadcast(t, 0)
    return t.tolist()


_sends: list = []  # this step's activations in flight to the next stage (kept alive until sent)


def recv_prev(tokens: int, hidden: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous stage's (hidden state, residual) of the next microbatch, `tokens` rows each."""
    buf = torch.empty(2, tokens, hidden, dtype=dtype, device=device)
    torch.distributed.recv(buf, _world + _size)
    return buf[0], buf[1]


def send_next(x: torch.Tensor, residual: torch.Tensor) -> None:
    """Hand (hidden state, residual) to the same TP rank of the next stage without waiting for it:
    this stage goes on with its next microbatch meanwhile."""
    t = torch.stack([x, residual]).contiguous()
    _sends.append((torch.distributed.isend(t, _world - _size), t))


def wait_sends() -> None:
    for work, _ in _sends:
        work.wait()
    _sends.clear()

"""Tensor parallelism over torch.distributed (gloo on CPUs, NCCL on GPUs): the rank's place in the
group, how a dimension splits across ranks, and the collectives the layers call.

Each rank is a worker process (xinfer/workers/worker.py) that reads the same step plans and runs
the same forward over its share of every layer: attention heads and MLP columns split by
column-parallel projections, the output projections row-parallel with one all-reduce per attention
and per MLP block (xinfer/models/layers.py), routed experts split along their intermediate size,
the LM head split along the vocabulary and gathered. Rank 0 samples and sends the tokens to the
others, so every rank's persistent batch holds the same sequences.
"""
from __future__ import annotations

import datetime
import os

import torch

from xinfer.errors import ModelLoadError

_rank, _size = 0, 1

# Families whose every projection goes through the shared Attention / GatedMLP / SparseMoe layers:
# what the layers shard. Kept without importing the models (the engine core checks at start-up).
TP_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                    "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
                    "Glm4ForCausalLM", "Glm4MoeForCausalLM")


def check(config, model_cfg: dict) -> None:
    """Start-up check: ModelLoadError naming why this engine can't run tensor parallel."""
    tp = config.tensor_parallel_size
    if tp == 1:
        return
    why = None
    archs = model_cfg.get("architectures") or []
    heads, kv = model_cfg["num_attention_heads"], model_cfg.get("num_key_value_heads") or model_cfg["num_attention_heads"]
    if not any(a in TP_ARCHITECTURES for a in archs):
        why = f"{', '.join(archs) or 'this model'} is not sharded yet (tensor parallel runs {', '.join(TP_ARCHITECTURES)})"
    elif config.num_speculative_tokens:
        why = "speculative decoding does not run tensor parallel yet"
    elif kv < tp and (tp % kv or heads % tp):
        why = (f"{kv} KV heads are fewer than the ranks: replicating them needs the ranks to be a multiple of "
               f"them and the {heads} query heads to split evenly")
    if why:
        raise ModelLoadError(f"--tensor-parallel-size {tp}: {why}")


def init(rank: int, size: int, store: str, device: torch.device) -> None:
    """Join the group (a worker, before it builds the model) through the FileStore `store`; gloo
    talks over the loopback interface. On a CPU, pin this rank to its share of the cores so the
    ranks' thread pools don't compete."""
    global _rank, _size
    _rank, _size = rank, size
    if size == 1:
        return
    if device.type == "cpu":
        cores = sorted(os.sched_getaffinity(0))
        per = max(1, len(cores) // size)
        mine = cores[rank * per:(rank + 1) * per] or cores[-per:]
        os.sched_setaffinity(0, mine)
        torch.set_num_threads(len(mine))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}",
                                         rank=rank, world_size=size, timeout=datetime.timedelta(seconds=120))


def rank() -> int:
    return _rank


def size() -> int:
    return _size


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
        torch.distributed.all_reduce(x)
    return x


def gather_vocab(local: torch.Tensor, n: int) -> torch.Tensor:
    """Each rank's logits [T, count] -> every rank's [T, n]."""
    _, count, per = vocab_part(n)
    if count < per:
        local = torch.nn.functional.pad(local, (0, per - count))
    parts = [torch.empty_like(local) for _ in range(_size)]
    torch.distributed.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=-1)[:, :n]


def broadcast_tokens(tokens: list[int], count: int) -> list[int]:
    """Rank 0's `count` sampled tokens, on every rank."""
    if _size == 1:
        return tokens
    t = torch.tensor(tokens if _rank == 0 else [0] * count, dtype=torch.int64)
    torch.distributed.broadcast(t, 0)
    return t.tolist()

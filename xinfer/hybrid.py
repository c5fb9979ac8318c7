"""Hybrid models: Gated DeltaNet linear-attention layers between full-attention ones (Qwen3-Next,
Qwen3.5). What the engine core needs to know about them, without torch (the scheduler reads it).

A linear-attention layer keeps no KV per token but one recurrent state per sequence (its conv
window and its delta-rule state), in a pool beside the paged KV cache with one slot per running
sequence (--max-num-seqs slots). The scheduler owns the slots as it owns the blocks: a sequence
takes one when it joins the running batch (NewSeq.state_slot) and gives it back whenever its
blocks go (finish, preemption, a worker restart); the worker zeroes a slot when a sequence starts
at position 0. So the state, like the KV, is rebuilt by recompute from the tokens.

Prefix caching: a cache hit must also give the recurrent state after the matched tokens, so the
pool holds snapshot slots too (EngineConfig.hybrid_state_snapshots of them, after the running
ones). Every XINFER_MAMBA_SNAPSHOT_STRIDE_BLOCKS full blocks of a sequence's computed tokens, in
prefill or decode, the step plan asks the worker to copy the state at that boundary into a snapshot
slot (StepPlan.state_snapshots: mid-chunk too, the delta rule split there); once the step is back
the snapshot is filed under the block hash the prefix cache already gives the boundary's last
block. The state after a token prefix depends on those tokens only, and the chained hash names
them, so a snapshot stays valid whatever becomes of its block; slots are reused least recently
used first, those whose block left the cache before the others. A hit is cut back to its last
block with a snapshot, which the new sequence's slot starts from (StepPlan.state_restores); the
tokens after it are recomputed.

What hybrids do not do yet, and refuse rather than get wrong: speculative decoding (rejected drafts
would need the state rolled back).
"""
from __future__ import annotations

import logging
from collections import OrderedDict

from xinfer import envs
from xinfer.errors import ModelLoadError
from xinfer.kv_cache import block_hash

log = logging.getLogger("xinfer.hybrid")


def layer_types(cfg: dict) -> list[str]:
    """Each layer's kind ("linear_attention" or "full_attention"): the config's list, or every
    `full_attention_interval`-th layer full (Qwen3-Next's original config keys)."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    every = cfg.get("full_attention_interval", 4)
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(cfg["num_hidden_layers"])]


def is_hybrid(cfg: dict) -> bool:
    return "linear_conv_kernel_dim" in cfg and "linear_attention" in layer_types(cfg)


def num_kv_layers(cfg: dict) -> int:
    """The layers that keep K/V in the paged cache."""
    if not is_hybrid(cfg):
        return cfg["num_hidden_layers"]
    return sum(t != "linear_attention" for t in layer_types(cfg))


class StateSlots:
    """The worker's state pool as the scheduler sees it: slots 0 .. running - 1 for running sequences,
    the `snapshots` after them for prefix-cache snapshots."""

    def __init__(self, running: int, snapshots: int = 0, stride: int = 1):
        self.num, self.snapshots, self.stride = running, snapshots, stride
        self.free = list(range(running - 1, -1, -1))
        self.free_snaps = list(range(running + snapshots - 1, running - 1, -1))
        self.saved: OrderedDict[int, int] = OrderedDict()  # block hash -> snapshot slot, least recent first
        self.pending: list[tuple[int, int]] = []  # the step in flight's captures: (block hash, slot)
        self.resumes: dict[int, int] = {}  # seq id -> the snapshot its admission this step starts from

    def take(self) -> int:
        assert self.free, "more running sequences than state slots"
        return self.free.pop()

    def give(self, slot: int) -> None:
        assert 0 <= slot < self.num and slot not in self.free, f"state slot {slot} given back twice"
        self.free.append(slot)

    # ---- prefix-cache snapshots ----
    def resume(self, seq_id: int, hashes: list[int]) -> int:
        """How many of a prefix hit's blocks to keep: up to the last one with a snapshot."""
        for k in range(len(hashes), 0, -1):
            slot = self.saved.get(hashes[k - 1])
            if slot is not None:
                self.saved.move_to_end(hashes[k - 1])
                self.resumes[seq_id] = slot
                return k
        self.resumes.pop(seq_id, None)
        return 0

    def plan(self, scheduled, new_seqs, block_size: int, cached) -> dict:
        """The step plan's state_restores and state_snapshots for the scheduled (sequence, tokens, ...)
        rows; `cached`: the prefix cache's hash -> block map."""
        # a match whose admission failed is matched again when it is next tried
        restores = [(ns.seq_id, self.resumes[ns.seq_id]) for ns in new_seqs
                    if ns.num_computed and ns.seq_id in self.resumes]
        self.resumes = {}
        if not self.snapshots:
            return {}
        every, captures = self.stride * block_size, []
        for seq, n, *_ in scheduled:
            hashes, keys = seq.block_hashes, None
            for pos in range((seq.num_computed // every + 1) * every, seq.num_computed + n + 1, every):
                keys = keys or seq.cache_keys
                hashes = chain(hashes, keys, pos // block_size, block_size)
                h = hashes[-1]
                if h in self.saved or any(h == p for p, _ in self.pending):
                    continue  # two sequences with this prefix at once: one copy
                slot = self._take_snapshot(cached)
                if slot is None:
                    break
                self.pending.append((h, slot))
                captures.append((seq.seq_id, pos, slot))
        return {"state_restores": restores, "state_snapshots": captures}

    def _take_snapshot(self, cached) -> int | None:
        if self.free_snaps:
            return self.free_snaps.pop()
        if not self.saved:
            return None  # every slot is being written this step
        h = next((h for h in self.saved if h not in cached), next(iter(self.saved)))
        return self.saved.pop(h)

    def commit(self) -> None:
        """The step is back: its captures are valid (whatever became of their sequences since)."""
        self.saved.update(self.pending)
        self.pending = []

    def forget(self) -> None:
        """The worker's state pool is gone (or a step failed mid-way): no snapshot is valid."""
        self.free_snaps.extend(self.saved.values())
        self.free_snaps.extend(slot for _, slot in self.pending)
        self.saved.clear()
        self.pending, self.resumes = [], {}

    def check_integrity(self) -> None:
        snaps = list(self.saved.values()) + [s for _, s in self.pending] + self.free_snaps
        assert sorted(snaps) == list(range(self.num, self.num + self.snapshots)), "snapshot slots lost or shared"


def chain(hashes: list[int], keys: list, blocks: int, block_size: int) -> list[int]:
    """The prefix cache's chained hashes of the first `blocks` blocks, `hashes` extended."""
    out = list(hashes[:blocks])
    while len(out) < blocks:
        i = len(out)
        out.append(block_hash(out[-1] if out else None, keys[i * block_size:(i + 1) * block_size]))
    return out


def num_snapshots(config) -> int:
    """Snapshot slots in the state pool: none without prefix caching."""
    if not config.enable_prefix_cache:
        return 0
    n = config.hybrid_state_snapshots
    if n is not None and n < 0:
        raise ValueError(f"--hybrid-state-snapshots must be >= 0, got {n}")
    return config.max_num_seqs if n is None else n


def check(config, model_cfg: dict) -> None:
    """Start-up check (xinfer/spec.py check, before the worker starts): no speculation for hybrids."""
    if is_hybrid(model_cfg) and config.num_speculative_tokens:
        raise ModelLoadError(f"speculative decoding is not supported for {model_cfg.get('model_type', 'hybrid')} "
                             "models (linear-attention layers): rejected drafts would need their recurrent state "
                             "rolled back, which xinfer does not do yet; drop --num-speculative-tokens / "
                             "--speculative-method / --draft-model")


def setup(config, model_cfg: dict) -> StateSlots | None:
    """A hybrid model's state slots (None: not a hybrid), its settings checked."""
    if not is_hybrid(model_cfg):
        return None
    check(config, model_cfg)
    snaps = num_snapshots(config)
    if config.enable_prefix_cache and not snaps:
        log.info("prefix caching is off for this hybrid model: --hybrid-state-snapshots 0 keeps no "
                 "linear-attention state for a cache hit to resume from")
    return StateSlots(config.max_num_seqs, snaps, envs.mamba_snapshot_stride_blocks())


def row_snapshots(plan, seqs) -> list[list[tuple[int, int]]] | None:
    """The worker's view of StepPlan.state_snapshots: for each scheduled row, (tokens into the row,
    snapshot slot) pairs; `seqs`: the worker's sequences, before the step counts its tokens."""
    if not plan.state_snapshots:
        return None
    at: dict[int, list] = {}
    for sid, pos, slot in plan.state_snapshots:
        at.setdefault(sid, []).append((pos - seqs[sid].num_computed, slot))
    return [at.get(s.seq_id, []) for s in plan.scheduled]

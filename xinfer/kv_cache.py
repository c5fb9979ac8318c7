"""KV block allocation and the prefix cache.

Blocks are reference counted. A full block of a sequence is registered under a hash
chained on its parent block's hash, so equal prefixes map to equal block chains. Blocks
whose count drops to zero go to a free list in least-recently-used order; they keep
their hash (and stay reusable) until the allocator takes them for new data.

A prompt that goes on past its cached blocks into part of a cached block (a chat template's shared
system prompt ending mid-block) reuses that part too: the newest cached children of the last matched
block are kept with their tokens, and the scheduler has the worker copy the matching slots into the
prompt's own next block (llama.cpp's server reuses a prompt at token granularity too).
"""
from __future__ import annotations

from collections import OrderedDict


MAX_CHILDREN = 16  # cached continuations a block keeps for partial matches


def block_hash(parent: int | None, tokens) -> int:
    return hash((parent, tuple(tokens)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True,
                 max_cached_tokens: int | None = None):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_cache = enable_prefix_cache
        self.max_cached_blocks = None if max_cached_tokens is None else max_cached_tokens // block_size
        self.ref = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        # parent hash (None: a first block) -> {cached child block: its tokens}, oldest first, capped
        self.children: dict[int | None, dict[int, tuple]] = {}
        self.parent_of: dict[int, int | None] = {}
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    # ---- prefix cache ----
    def match_prefix(self, tokens: list[int]) -> tuple[list[int], list[int]]:
        """Longest chain of cached full blocks for `tokens`: (block ids, their hashes). Takes no reference."""
        if not self.enable_prefix_cache:
            return [], []
        blocks, hashes, parent = [], [], None
        bs = self.block_size
        for i in range(len(tokens) // bs):
            h = block_hash(parent, tokens[i * bs:(i + 1) * bs])
            b = self.cached.get(h)
            if b is None:
                break
            blocks.append(b)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def match_partial(self, parent: int | None, tokens: list) -> tuple[int | None, int]:
        """The cached block after `parent` whose first tokens match most of `tokens` (fewer than a
        block): (block id, how many match), (None, 0) if none does. Takes no reference: the worker
        copies its slots before the step's forward, and a step that could overwrite it comes later."""
        best, most = None, 0
        for b, toks in reversed(self.children.get(parent, {}).items()):
            k = 0
            for a, t in zip(toks, tokens):
                if a != t:
                    break
                k += 1
            if k > most:
                best, most = b, k
                if k == len(tokens):
                    break
        return best, most

    def acquire(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                self.free.pop(b, None)
            self.ref[b] += 1

    def register(self, block: int, h: int, parent: int | None, tokens) -> None:
        """Record a newly filled block under its hash (first writer wins on duplicates), and with its
        tokens among its parent's children for partial matches."""
        if not self.enable_prefix_cache or h in self.cached:
            return
        self.cached[h] = block
        self.hash_of[block] = h
        kids = self.children.setdefault(parent, {})
        kids[block] = tuple(tokens)
        self.parent_of[block] = parent
        if len(kids) > MAX_CHILDREN:  # a popular prefix's many continuations: scan the newest only
            old = next(iter(kids))
            del kids[old], self.parent_of[old]
        self._enforce_cap()

    def _enforce_cap(self):
        """Forget the least recently used unreferenced cached blocks beyond the cap (blocks
        still in use stay cached; they are trimmed when released)."""
        if self.max_cached_blocks is None or len(self.cached) <= self.max_cached_blocks:
            return
        for b in self.free:
            if self.hash_of[b] is not None:
                self._unhash(b)
                if len(self.cached) <= self.max_cached_blocks:
                    return

    def _unhash(self, b: int) -> None:
        h = self.hash_of[b]
        if h is not None and self.cached.get(h) == b:
            del self.cached[h]
        self.hash_of[b] = None
        if b in self.parent_of:
            p = self.parent_of.pop(b)
            kids = self.children[p]
            del kids[b]
            if not kids:
                del self.children[p]

    # ---- allocation ----
    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            self._unhash(b)
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        # Tail blocks first into the LRU order: they are the least likely to be shared.
        for b in reversed(blocks):
            self.ref[b] -= 1
            assert self.ref[b] >= 0, f"block {b} released twice"
            if self.ref[b] == 0:
                self.free[b] = None
                if self.hash_of[b] is None:  # holds nothing reusable: hand it out first
                    self.free.move_to_end(b, last=False)
        self._enforce_cap()

    def forget_cached(self) -> None:
        """Drop every prefix-cache entry (the KV data behind them is gone)."""
        for b in range(self.num_blocks):
            self.hash_of[b] = None
        self.cached.clear()
        self.children.clear()
        self.parent_of.clear()

    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def check_integrity(self) -> None:
        """Invariants, for tests and idle-time checks."""
        assert all(r >= 0 for r in self.ref)
        assert set(self.free) == {b for b in range(self.num_blocks) if self.ref[b] == 0}
        for h, b in self.cached.items():
            assert self.hash_of[b] == h
        for p, kids in self.children.items():
            assert kids and all(self.hash_of[b] is not None and self.parent_of[b] == p for b in kids)
        assert len(self.parent_of) == sum(len(k) for k in self.children.values())

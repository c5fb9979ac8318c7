"""Paged attention: the per-step metadata, the backend interface and the torch backend.

A step's batch is a flat list of query tokens. Sequence b owns query rows
cu_seqlens_q[b]:cu_seqlens_q[b+1]; its KV length after this step is seq_lens[b]
(the new tokens' K/V are stored before attention runs), so its query row i sits at
position seq_lens[b] - q_len + i. KV position p of sequence b lives in cache block
block_tables[b, p // block_size] at offset p % block_size. Cache layout per layer:
[num_blocks, block_size, num_kv_heads, head_dim] for K and for V, in the --kvcache-dtype's storage
dtype (fp8 caches carry their scales beside them: ops/kv_quant.py).

The metadata lives in a per-step context (set by the model runner) so model code
never threads it through forward signatures.
"""
from __future__ import annotations

import abc

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ops import kv_quant


FLAT_MAX = 16  # see AttnMetadata.is_short


@dataclass
class AttnMetadata:
    cu_seqlens_q: torch.Tensor  # int32 [B+1]
    seq_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    slot_mapping: torch.Tensor  # int64 [T]
    query_lens: list[int]  # host copies, so backends never sync on them
    kv_lens: list[int]
    block_size: int
    # Hybrid models: each sequence's slot in the recurrent-state pool (xinfer/hybrid.py); None: slot
    # i for sequence i (a runner with one sequence alone, as log_probs)
    state_slots: list[int] | None = None
    # and where to snapshot that state (prefix caching): per sequence, (tokens into its row, snapshot
    # slot) pairs; None: nowhere
    state_snapshots: list[list[tuple[int, int]]] | None = None
    # Gemma 3's images: per sequence, [lo, hi) KV positions whose tokens also see the later ones among
    # them (one image's tokens), only spans that hold query rows of this step, all of whose K/V the step
    # has (the scheduler never ends a chunk inside one); None: causal everywhere
    bidirectional: list[list[tuple[int, int]]] | None = None
    # Backend-private values derived once per step and reused by every layer.
    cache: dict = field(default_factory=dict)

    def __post_init__(self):
        self.query_starts = [0]
        for n in self.query_lens:
            self.query_starts.append(self.query_starts[-1] + n)

    @property
    def max_seqlen_q(self) -> int:
        return max(self.query_lens, default=0)

    def is_short(self, i: int) -> bool:
        """A query that runs as one decode per row: one token, or a few after some context (a
        sequence verifying speculative drafts, a small chunk), each row over the KV up to itself."""
        n = self.query_lens[i]
        if self.bidirectional and self.bidirectional[i]:  # its rows see past themselves: a prefill
            return False
        return n == 1 or (n <= FLAT_MAX and self.kv_lens[i] > n)

    def row_decode(self):
        """When every query is short: (block table, KV length) per query row, or None."""
        if "rows" not in self.cache:
            if self.max_seqlen_q == 1:
                self.cache["rows"] = (self.block_tables, self.seq_lens)
            elif all(self.is_short(i) for i in range(len(self.query_lens))):
                seq = torch.tensor([i for i, n in enumerate(self.query_lens) for _ in range(n)],
                                   device=self.block_tables.device)
                lens = [kl - n + j + 1 for n, kl in zip(self.query_lens, self.kv_lens) for j in range(n)]
                self.cache["rows"] = (self.block_tables[seq].contiguous(),
                                      torch.tensor(lens, dtype=torch.int32, device=seq.device))
            else:
                self.cache["rows"] = None
        return self.cache["rows"]


class AttentionBackend(abc.ABC):
    name = "base"

    @abc.abstractmethod
    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        """Write the step's new K/V [T, Hkv, D] into the cache at their slots."""

    @abc.abstractmethod
    def forward(self, q, k_cache, v_cache, meta: AttnMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """Attention of q [T, Hq, D] over the paged cache; returns [T, Hq, D]."""


class TorchBackend(AttentionBackend):
    """Runs anywhere. Decodes are batched into one padded SDPA call; each prefill chunk
    runs alone with an explicit causal (and sliding-window) mask; both gather (and dequantize, see
    ops/kv_quant.py) only the cache rows they read. On a CPU where the C kernels build
    (ops/cpu_kernels.py), float32 decodes and prefills read the paged cache in place instead, in any of
    its formats (prefills with bidirectional spans, a vision model's images, stay on SDPA)."""

    name = "torch"

    def __init__(self):
        from ops import cpu_kernels
        self._c = cpu_kernels.lib()
        self._attends = cpu_kernels.attends

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        for x, cache in ((k, k_cache),) if v_cache is k_cache else ((k, k_cache), (v, v_cache)):  # MLA: k is v
            if not self._store_c(x, cache, slot_mapping):
                kv_quant.store(x, cache, slot_mapping)

    def _store_c(self, x, cache, slots) -> bool:
        """float32 K or V rows (a view into the QKV output) into a CPU cache that is not turbo in one
        C call, writing the bytes kv_quant.store writes (tests/test_kv_quant.py): no cast and copy first."""
        kind = kv_quant.c_kind(cache)
        if (self._c is None or kind is None or kind == kv_quant.TURBO_KIND or cache.device.type != "cpu"
                or x.dtype != torch.float32 or x.dim() != 3 or x.stride()[1:] != (x.shape[2], 1)
                or slots.dtype != torch.int64 or not slots.is_contiguous()):
            return False
        s = kv_quant.scales(cache)
        self._c.xinfer_kv_store(cache.data_ptr(), None if s is None else s.data_ptr(), kind, slots.data_ptr(),
                                x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], x.shape[2], 0, None, None, None, None)
        return True

    def _plan(self, meta: AttnMetadata, device, dtype, c_kind, head_dim):
        plan = meta.cache.get("torch")
        if plan is not None:
            return plan
        bs = meta.block_size
        short = [i for i in range(len(meta.query_lens)) if meta.is_short(i)]
        pre = sorted(set(range(len(meta.query_lens))) - set(short))
        plan = {"prefill": pre, "decode": None, "decode_c": None, "prefill_c": None}
        c_ok = self._c is not None and device.type == "cpu" and dtype == torch.float32 and c_kind is not None \
            and self._attends(head_dim)
        if pre and c_ok and all(meta.query_lens[i] for i in pre) \
                and not any(meta.bidirectional[i] for i in pre if meta.bidirectional):
            ints = lambda xs: torch.tensor(xs, dtype=torch.int32)
            plan["prefill_c"] = (meta.block_tables[torch.tensor(pre, device=device)].to(torch.int32).contiguous(),
                                 ints([meta.query_starts[i] for i in pre]), ints([meta.query_lens[i] for i in pre]),
                                 ints([meta.kv_lens[i] for i in pre]))
            plan["prefill"] = []
        dec = [i for i in short for _ in range(meta.query_lens[i])]
        if dec:
            dec_t = torch.tensor(dec, device=device)
            rows_l = [meta.query_starts[i] + j for i in short for j in range(meta.query_lens[i])]
            rows = torch.tensor(rows_l, device=device)
            lens_l = [meta.kv_lens[i] - meta.query_lens[i] + j + 1 for i in short for j in range(meta.query_lens[i])]
            lens_t = torch.tensor(lens_l, dtype=torch.int32, device=device)
        if dec and c_ok:
            plan["decode_c"] = (rows, not pre, meta.block_tables[dec_t].contiguous(), lens_t)
        elif dec:
            lens = lens_t.long()
            max_len = max(lens_l)
            nblk = -(-max_len // bs)
            tables = meta.block_tables[dec_t, :nblk].long()
            offs = torch.arange(nblk * bs, device=device)
            slots = (tables[:, offs // bs] * bs + offs % bs)[:, :max_len]  # [Bd, L]
            pos = torch.arange(max_len, device=device)
            plan["decode"] = (rows, slots, pos[None, :] < lens[:, None], lens - 1, pos)
        meta.cache["torch"] = plan
        return plan

    def forward(self, q, k_cache, v_cache, meta, scale, sliding_window=None, softcap=None):
        return _in_frame(q, k_cache, lambda q: self._forward(q, k_cache, v_cache, meta, scale, sliding_window, softcap))

    def _forward(self, q, k_cache, v_cache, meta, scale, sliding_window, softcap):
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # rows Hq * D apart, as the C kernels write
        nb, bs, hkv, d = *k_cache.shape[:3], q.shape[-1]  # a turbo cache's last dimension is its packed bytes
        plan = self._plan(meta, q.device, q.dtype, kv_quant.c_kind(k_cache), d)
        starts = meta.query_starts
        if plan["prefill_c"] is not None:
            tables, q_starts, q_lens, kv_lens = plan["prefill_c"]
            if q.stride()[1:] != (d, 1):  # heads packed within a row, rows any distance apart
                q = q.contiguous()
            self._c.xinfer_paged_prefill(q.data_ptr(), q.stride(0), *_c_caches(k_cache, v_cache), tables.data_ptr(),
                                         tables.shape[1], q_starts.data_ptr(), q_lens.data_ptr(), kv_lens.data_ptr(),
                                         out.data_ptr(), len(q_lens), q.shape[1], hkv, d, bs, scale,
                                         sliding_window or 0, softcap or 0.0, *_c_turbo(k_cache))
        if plan["decode_c"] is not None:
            rows, every_row, tables, lens = plan["decode_c"]
            qd = q if every_row else q[rows]
            if qd.stride()[1:] != (d, 1):
                qd = qd.contiguous()
            od = torch.empty(qd.shape, dtype=qd.dtype)
            self._c.xinfer_paged_decode(qd.data_ptr(), qd.stride(0), *_c_caches(k_cache, v_cache), tables.data_ptr(),
                                        tables.shape[1], lens.data_ptr(), od.data_ptr(), qd.shape[0], qd.shape[1], hkv,
                                        d, bs, scale, sliding_window or 0, softcap or 0.0, *_c_turbo(k_cache))
            if every_row:
                return od
            out[rows] = od
        elif plan["decode"] is not None:
            rows, slots, valid, qpos, pos = plan["decode"]
            mask = valid
            if sliding_window:
                mask = mask & (pos[None, :] > qpos[:, None] - sliding_window)
            qd = q[rows].unsqueeze(2)  # [Bd, Hq, 1, D]
            kd = kv_quant.gather(k_cache, slots, q.dtype).transpose(1, 2)  # [Bd, Hkv, L, D]
            vd = kv_quant.gather(v_cache, slots, q.dtype).transpose(1, 2)
            out[rows] = _sdpa(qd, kd, vd, mask[:, None, None, :], scale, softcap).squeeze(2)
        for i in plan["prefill"]:
            ql, kl = meta.query_lens[i], meta.kv_lens[i]
            s = starts[i]
            nblk = -(-kl // bs)
            table = meta.block_tables[i, :nblk].long()
            slots = (table[:, None] * bs + torch.arange(bs, device=q.device)).reshape(-1)[:kl]
            kpos = torch.arange(kl, device=q.device)
            qpos = torch.arange(kl - ql, kl, device=q.device)
            mask = kpos[None, :] <= qpos[:, None]
            spans = meta.bidirectional[i] if meta.bidirectional else None
            for lo, hi in spans or ():
                mask = mask | (((qpos >= lo) & (qpos < hi))[:, None] & ((kpos >= lo) & (kpos < hi))[None, :])
            if sliding_window:  # the window bounds the spans too (as transformers' Gemma 3 masks)
                mask = mask & (kpos[None, :] > qpos[:, None] - sliding_window)
            qs = q[s:s + ql].transpose(0, 1).unsqueeze(0)  # [1, Hq, ql, D]
            ks = kv_quant.gather(k_cache, slots, q.dtype).transpose(0, 1).unsqueeze(0)
            vs = kv_quant.gather(v_cache, slots, q.dtype).transpose(0, 1).unsqueeze(0)
            # a whole prompt at once is plain causal: the kernel then skips the masked half
            causal = ql == kl and not sliding_window and softcap is None and not spans
            out[s:s + ql] = _sdpa(qs, ks, vs, None if causal else mask[None, None], scale, softcap)[0].transpose(0, 1)
        return out


def _c_caches(k_cache, v_cache) -> tuple:
    """The C attention kernels' cache arguments: both caches, their scales (fp8, turbo) or NULL, the kind."""
    ks, vs = kv_quant.scales(k_cache), kv_quant.scales(v_cache)
    return (k_cache.data_ptr(), v_cache.data_ptr(), None if ks is None else ks.data_ptr(),
            None if vs is None else vs.data_ptr(), kv_quant.c_kind(k_cache))


def _c_turbo(k_cache) -> tuple:
    """A turbo cache's bits a value and codebook for the C kernels; (0, NULL) for the others."""
    bits, _, levels = getattr(k_cache, "kv_turbo", (0, None, None))
    return bits, None if levels is None else levels.data_ptr()


def _sdpa(q, k, v, mask, scale, softcap):
    """q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D], mask bool broadcastable to [B, Hq, Lq, Lk] (None: causal,
    Lq == Lk)."""
    hq, hkv = q.shape[1], k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=hq != hkv)
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


def _in_frame(q, k_cache, attend):
    """attend(q), where a turbo cache is read in its rotated frame (ops/turbo_quant.py): the queries
    rotated in, the output rotated back out."""
    rot = kv_quant.rotation(k_cache)
    if rot is None:
        return attend(q)
    rot = rot.to(q.dtype)
    return attend((q @ rot.T).contiguous()) @ rot


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self):
        from ops import triton_attention
        self._k = triton_attention

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        if hasattr(k_cache, "kv_turbo"):  # quantized by torch (a rotation and a codebook a vector)
            keep = slot_mapping >= 0  # padding tokens have no slot
            kv_quant.store(k[keep], k_cache, slot_mapping[keep])
            kv_quant.store(v[keep], v_cache, slot_mapping[keep])
            return
        self._k.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q, k_cache, v_cache, meta, scale, sliding_window=None, softcap=None):
        return _in_frame(q, k_cache, lambda q: self._k.paged_attention(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, scale,
            sliding_window=sliding_window, softcap=softcap, max_seqlen_q=meta.max_seqlen_q))


# The per-step context: set by the model runner before each forward.
_CTX: dict = {"meta": None, "backend": None}


def set_context(meta: AttnMetadata | None, backend: AttentionBackend | None = None) -> None:
    _CTX["meta"] = meta
    if backend is not None:
        _CTX["backend"] = backend


def context() -> tuple[AttnMetadata | None, AttentionBackend | None]:
    return _CTX["meta"], _CTX["backend"]


def attend(q, k, v, k_cache, v_cache, scale, sliding_window=None, softcap=None):
    """q [T, Hq, D], k/v [T, Hkv, D]: store the new K/V, then attend over the paged cache."""
    meta, backend = _CTX["meta"], _CTX["backend"]
    backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.bidirectional and backend.name != "torch":
        # the Triton and FlashInfer kernels mask causally only: a step with an image's bidirectional
        # span runs on torch, which reads their cache layout as it is
        backend = _torch_backend()
    return backend.forward(q, k_cache, v_cache, meta, scale, sliding_window, softcap)


def _torch_backend() -> TorchBackend:
    if "torch_fallback" not in _CTX:
        _CTX["torch_fallback"] = TorchBackend()
    return _CTX["torch_fallback"]

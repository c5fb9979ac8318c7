"""FlashInfer attention backend.

FlashInfer describes a paged KV cache in CSR form: for sequence b, its pages are
kv_indices[kv_indptr[b]:kv_indptr[b+1]] and the last page holds last_page_len[b] entries
(1..page_size). Our block_tables / kv_lens map onto that directly (`paged_kv_csr`), and the
caches are already in FlashInfer's "NHD" page layout [num_pages, page_size, num_kv_heads, head_dim],
passed as a (k_cache, v_cache) tuple.

A wrapper's plan() is per batch and per attention variant: each distinct
(sliding_window, softcap, scale, ...) gets its own wrapper, planned once per step (tracked in
meta.cache) and then run by every layer of that variant. All wrappers share one workspace buffer;
they run one after another on the same stream.

flashinfer itself is imported only when the backend is constructed, so this module (and its
metadata conversion) imports fine without it.
"""
from __future__ import annotations

import importlib.util
import logging

import torch

from ops.attention import AttentionBackend, AttnMetadata, TorchBackend, TritonBackend

log = logging.getLogger("xinfer.attention")

WORKSPACE_BYTES = 128 * 1024 * 1024
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def paged_kv_csr(meta: AttnMetadata):
    """Our metadata -> FlashInfer's (qo_indptr, kv_indptr, kv_indices, last_page_len), all int32.

    The indptrs and last_page_len are built on the CPU from the host lists (plan() wants them
    there); kv_indices is gathered from block_tables on its own device, without a sync.
    Entries of block_tables past a sequence's last page are never read."""
    bs = meta.block_size
    kv_lens = torch.tensor(meta.kv_lens, dtype=torch.int64)
    pages = (kv_lens + bs - 1) // bs
    qo_indptr = torch.tensor(meta.query_starts, dtype=torch.int32)
    kv_indptr = torch.zeros(len(meta.kv_lens) + 1, dtype=torch.int64)
    kv_indptr[1:] = torch.cumsum(pages, 0)
    last_page_len = (kv_lens - 1) % bs + 1  # a full last page holds bs entries, never 0
    rows = torch.repeat_interleave(torch.arange(len(meta.kv_lens)), pages)
    cols = torch.arange(int(kv_indptr[-1])) - torch.repeat_interleave(kv_indptr[:-1], pages)
    dev = meta.block_tables.device
    kv_indices = meta.block_tables[rows.to(dev), cols.to(dev)].to(torch.int32)
    return qo_indptr, kv_indptr.to(torch.int32), kv_indices, last_page_len.to(torch.int32)


def window_left(sliding_window: int | None) -> int:
    """Our window W shows keys at positions > pos - W; FlashInfer's window_left is inclusive
    (keys at positions >= pos - window_left), so window_left = W - 1; -1 means no window."""
    return sliding_window - 1 if sliding_window else -1


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    store_kv = TorchBackend.store_kv

    def __init__(self):
        try:
            import flashinfer
        except ImportError as e:
            raise ImportError("attention backend 'flashinfer' needs the flashinfer package "
                              "(pip install flashinfer-python)") from e
        self._fi = flashinfer
        self._workspace = None
        self._wrappers = {}
        self._fallback = None

    def _wrapper(self, key, decode: bool, group: int, device):
        w = self._wrappers.get(key)
        if w is None:
            if self._workspace is None:
                self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            if decode:
                # CUDA-core decode kernels cover small GQA groups; larger groups go to tensor cores.
                w = self._fi.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD", use_tensor_cores=group > 4)
            else:
                w = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
            self._wrappers[key] = w
        return w

    def forward(self, q, k_cache, v_cache, meta, scale, sliding_window=None, softcap=None):
        if q.dtype not in SUPPORTED_DTYPES or q.shape[-1] > MAX_HEAD_DIM:
            return self._unsupported(q.dtype, q.shape[-1]).forward(q, k_cache, v_cache, meta, scale, sliding_window,
                                                                   softcap)
        step = meta.cache.get("flashinfer")
        if step is None:
            step = meta.cache["flashinfer"] = {
                "csr": paged_kv_csr(meta),
                "decode": all(n == 1 for n in meta.query_lens),
                "planned": set(),
            }
        _, hq, d = q.shape
        hkv = k_cache.shape[2]
        decode = step["decode"]
        key = (decode, window_left(sliding_window), float(softcap or 0.0), float(scale), hq, hkv, d,
               q.dtype, k_cache.dtype)
        w = self._wrapper(key, decode, hq // hkv, q.device)
        if key not in step["planned"]:
            qo_indptr, kv_indptr, kv_indices, last_page_len = step["csr"]
            common = dict(window_left=key[1], logits_soft_cap=key[2], sm_scale=key[3],
                          q_data_type=q.dtype, kv_data_type=k_cache.dtype)
            if decode:
                w.plan(kv_indptr, kv_indices, last_page_len, hq, hkv, d, meta.block_size, **common)
            else:
                w.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, hq, hkv, d, meta.block_size,
                       causal=True, **common)
            step["planned"].add(key)
        return w.run(q.contiguous(), (k_cache, v_cache))

    def _unsupported(self, dtype, head_dim):
        """FlashInfer kernels take fp16/bf16 only, and heads up to 256: other dtypes (e.g. --dtype float32)
        and MLA's latent heads (576) go to Triton or torch."""
        if self._fallback is None:
            name = "triton" if importlib.util.find_spec("triton") else "torch"
            log.warning("flashinfer does not support %s with head size %d; attention falls back to the %s backend",
                        dtype, head_dim, name)
            self._fallback = TritonBackend() if name == "triton" else TorchBackend()
        return self._fallback

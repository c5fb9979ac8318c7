"""CPU checks of the FlashInfer backend's metadata conversion and of the 'auto' backend choice.
(The kernels themselves are compared with the torch backend in test_flashinfer_gpu.py.)"""
import importlib.util

import pytest
import torch

from ops import attention as A
from ops import backends as B
from ops.flashinfer_attention import paged_kv_csr, window_left

BS = 16
# decode, chunked prefill with context, exact multiples of the block size, fresh prefill, 1-token sequence
Q_LENS = [1, 7, 1, 20, 5, 1, 16]
KV_LENS = [37, 30, 16, 20, 53, 1, 32]


def make_meta(q_lens, kv_lens, bs=BS, seed=0, pad=-1):
    """Block tables drawn from a shuffled pool, padded past each sequence's last block with `pad`."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-n // bs) for n in kv_lens]
    pool = torch.randperm(sum(nblk) + 7, generator=g)
    tables = torch.full((len(kv_lens), max(nblk) + 2), pad, dtype=torch.int32)
    used = 0
    slots = []
    for b, (n, ql, kl) in enumerate(zip(nblk, q_lens, kv_lens)):
        tables[b, :n] = pool[used:used + n].to(torch.int32)
        used += n
        p = torch.arange(kl - ql, kl)
        slots.append(tables[b, p // bs].long() * bs + p % bs)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    meta = A.AttnMetadata(cu_seqlens_q=cu, seq_lens=torch.tensor(kv_lens, dtype=torch.int32), block_tables=tables,
                          slot_mapping=torch.cat(slots), query_lens=list(q_lens), kv_lens=list(kv_lens),
                          block_size=bs)
    return meta, len(pool)


def torch_backend_slots(meta, b):
    """The flat cache rows the torch backend reads for sequence b (its prefill formula; for decodes
    also checked against the slots its own per-step plan gathers)."""
    bs, kl = meta.block_size, meta.kv_lens[b]
    table = meta.block_tables[b, :-(-kl // bs)].long()
    slots = (table[:, None] * bs + torch.arange(bs)).reshape(-1)[:kl]
    backend = A.TorchBackend()
    backend._c = None  # the gather plan, which the C decode kernel skips
    plan = backend._plan(meta, torch.device("cpu"), torch.float32, 0, 64)  # a float32 cache (C kind 0), head size 64
    if meta.query_lens[b] == 1:
        rows, dec_slots, valid, _, _ = plan["decode"]
        i = rows.tolist().index(meta.query_starts[b])
        assert torch.equal(dec_slots[i][valid[i]], slots)
    return slots


def csr_rows(kv_cache, csr, b):
    """Read sequence b's KV rows the way FlashInfer does: its pages in order, the last one partially."""
    _, kv_indptr, kv_indices, last = csr
    pages = kv_indices[kv_indptr[b]:kv_indptr[b + 1]].long()
    rows = kv_cache[pages].flatten(0, 1)  # [n_pages * page_size, H, D]
    return rows[:(len(pages) - 1) * kv_cache.shape[1] + int(last[b])]


@pytest.mark.parametrize("pad", [-1, 0])
def test_csr_reads_the_same_kv_rows_as_the_torch_backend(pad):
    meta, num_blocks = make_meta(Q_LENS, KV_LENS, pad=pad)
    csr = paged_kv_csr(meta)
    qo_indptr, kv_indptr, kv_indices, last = csr
    for t in csr:
        assert t.dtype == torch.int32 and t.device.type == "cpu"
    assert qo_indptr.tolist() == meta.cu_seqlens_q.tolist()
    assert kv_indptr.tolist()[1:] == torch.cumsum(torch.tensor([-(-n // BS) for n in KV_LENS]), 0).tolist()
    assert len(kv_indices) == kv_indptr[-1]
    assert kv_indices.min() >= 0 and kv_indices.max() < num_blocks  # padding never read
    assert last.tolist() == [5, 14, 16, 4, 5, 1, 16]
    assert ((last >= 1) & (last <= BS)).all()

    cache = torch.randn(num_blocks, BS, 2, 8)
    flat = cache.view(-1, 2, 8)
    for b in range(len(KV_LENS)):
        assert torch.equal(csr_rows(cache, csr, b), flat[torch_backend_slots(meta, b)])


def test_csr_block_size_one_and_single_sequence():
    meta, num_blocks = make_meta([3], [3], bs=1)
    _, kv_indptr, kv_indices, last = paged_kv_csr(meta)
    assert kv_indptr.tolist() == [0, 3]
    assert kv_indices.tolist() == meta.block_tables[0, :3].tolist()
    assert last.tolist() == [1]


def flashinfer_semantics(q, k_cache, v_cache, csr, scale, wl, softcap):
    """Attention as FlashInfer documents it for causal append: query i of a sequence with qo_len queries and
    kv_len keys sits at kv_len - qo_len + i; key j is visible when j <= that and (wl < 0 or j >= pos - wl)."""
    qo_indptr = csr[0]
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_cache.shape[2]
    for b in range(len(qo_indptr) - 1):
        s, e = int(qo_indptr[b]), int(qo_indptr[b + 1])
        k = csr_rows(k_cache, csr, b).repeat_interleave(hq // hkv, 1)
        v = csr_rows(v_cache, csr, b).repeat_interleave(hq // hkv, 1)
        kl = k.shape[0]
        qpos = torch.arange(kl - (e - s), kl)[:, None]
        kpos = torch.arange(kl)[None, :]
        mask = kpos <= qpos
        if wl >= 0:
            mask &= kpos >= qpos - wl
        scores = torch.einsum("qhd,khd->hqk", q[s:e], k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        p = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
        out[s:e] = torch.einsum("hqk,khd->qhd", p, v)
    return out


@pytest.mark.parametrize("window,softcap", [(None, None), (8, None), (17, 30.0), (1, None)])
def test_window_left_mapping_matches_torch_backend(window, softcap):
    meta, num_blocks = make_meta(Q_LENS, KV_LENS, seed=3)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(sum(Q_LENS), 4, 16, generator=g)
    kc = torch.randn(num_blocks, BS, 2, 16, generator=g)
    vc = torch.randn(num_blocks, BS, 2, 16, generator=g)
    ref = A.TorchBackend().forward(q, kc, vc, meta, 0.25, window, softcap)
    out = flashinfer_semantics(q, kc, vc, paged_kv_csr(meta), 0.25, window_left(window), softcap)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_window_left():
    assert window_left(None) == -1
    assert window_left(0) == -1
    assert window_left(4096) == 4095


def test_auto_choice():
    assert B.auto_backend_name("cuda", True, True) == "flashinfer"
    assert B.auto_backend_name("cuda", True, False) == "flashinfer"
    assert B.auto_backend_name("cuda", False, True) == "triton"
    assert B.auto_backend_name("cuda", False, False) == "torch"
    for dev in ("cpu", "mps"):
        assert B.auto_backend_name(dev, True, True) == "torch"


def _fake_find_spec(present):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name in present:
            return present[name]
        return real(name, *args, **kwargs)
    return find_spec


def test_get_backend_auto_without_flashinfer(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", _fake_find_spec({"flashinfer": None, "triton": None}))
    assert B.get_backend("auto", torch.device("cuda")).name == "torch"
    assert B.get_backend("auto", torch.device("cpu")).name == "torch"
    monkeypatch.setattr(importlib.util, "find_spec", _fake_find_spec({"flashinfer": None}))
    if importlib.util.find_spec("triton") is not None:
        assert B.get_backend("auto", torch.device("cuda")).name == "triton"


def test_flashinfer_is_registered_and_imported_lazily(monkeypatch):
    assert "flashinfer" in B.BACKENDS
    if importlib.util.find_spec("flashinfer") is not None:
        pytest.skip("flashinfer is installed here")
    # 'auto' on CUDA picks flashinfer when it is found; constructing it without the package says what is missing.
    monkeypatch.setattr(importlib.util, "find_spec", _fake_find_spec({"flashinfer": object()}))
    with pytest.raises(ImportError, match="flashinfer-python"):
        B.get_backend("auto", torch.device("cuda"))


# ----------------------------------------------------------------------------------------------------------------------
# The backend's glue (which wrapper, what plan() gets, one plan per variant per step), run against a stand-in
# flashinfer module whose wrappers compute `flashinfer_semantics` from the arguments they were planned with.
# ----------------------------------------------------------------------------------------------------------------------


class _FakeWrapper:
    def __init__(self, workspace, kv_layout, use_tensor_cores=False):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.use_tensor_cores = use_tensor_cores
        self.num_plans = 0

    def _plan(self, qo_indptr, kv_indptr, kv_indices, last, hq, hkv, d, page_size, window_left, logits_soft_cap,
              sm_scale, q_data_type, kv_data_type):
        for t in (qo_indptr, kv_indptr, last):
            assert t.dtype == torch.int32 and t.device.type == "cpu"
        self.num_plans += 1
        self.planned = ((qo_indptr, kv_indptr, kv_indices, last), (hq, hkv, d, page_size), window_left,
                        logits_soft_cap, sm_scale, q_data_type, kv_data_type)

    def run(self, q, paged_kv_cache):
        k, v = paged_kv_cache
        csr, (hq, hkv, d, page_size), wl, cap, scale, qdt, kvdt = self.planned
        assert (q.dtype, k.dtype, k.shape[1], k.shape[2], q.shape[1:]) == (qdt, kvdt, page_size, hkv, (hq, d))
        return flashinfer_semantics(q.float(), k.float(), v.float(), csr, scale, wl, cap).to(q.dtype)


class _FakePrefill(_FakeWrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, *, causal, window_left, logits_soft_cap, sm_scale,
             q_data_type, kv_data_type):
        assert causal
        self._plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                   num_kv_heads, head_dim_qk, page_size, window_left, logits_soft_cap, sm_scale, q_data_type,
                   kv_data_type)


class _FakeDecode(_FakeWrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             window_left, logits_soft_cap, sm_scale, q_data_type, kv_data_type):
        qo_indptr = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._plan(qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                   window_left, logits_soft_cap, sm_scale, q_data_type, kv_data_type)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    import sys
    import types
    mod = types.ModuleType("flashinfer")
    mod.BatchPrefillWithPagedKVCacheWrapper = _FakePrefill
    mod.BatchDecodeWithPagedKVCacheWrapper = _FakeDecode
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    from ops.flashinfer_attention import FlashInferBackend
    return FlashInferBackend()


def _step_inputs(q_lens, kv_lens, hq, hkv, d, dtype, seed):
    meta, num_blocks = make_meta(q_lens, kv_lens, seed=seed)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    kc = torch.randn(num_blocks, BS, hkv, d, generator=g).to(dtype)
    vc = torch.randn(num_blocks, BS, hkv, d, generator=g).to(dtype)
    return meta, q, kc, vc


def test_backend_plans_once_per_variant_per_step(fake_flashinfer):
    be, ref_be = fake_flashinfer, A.TorchBackend()
    # Gemma-style interleaving: sliding-window layers and full layers in one step.
    layers = [(8, 30.0), (None, 30.0), (8, 30.0), (None, 30.0)]
    for seed in (0, 1):  # two steps: every variant is planned again for the new batch
        meta, q, kc, vc = _step_inputs(Q_LENS, KV_LENS, 4, 2, 16, torch.bfloat16, seed)
        for window, cap in layers:
            out = be.forward(q, kc, vc, meta, 0.25, window, cap)
            ref = ref_be.forward(q, kc, vc, meta, 0.25, window, cap)
            assert out.shape == q.shape and out.dtype == q.dtype
            torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        assert len(be._wrappers) == 2
        assert all(isinstance(w, _FakePrefill) and w.num_plans == seed + 1 for w in be._wrappers.values())


def test_backend_decode_only_step_uses_decode_wrapper(fake_flashinfer):
    be = fake_flashinfer
    meta, q, kc, vc = _step_inputs([1, 1, 1], [37, 1, 32], 16, 2, 16, torch.float16, 5)
    out = be.forward(q, kc, vc, meta, 0.25, None, None)
    ref = A.TorchBackend().forward(q, kc, vc, meta, 0.25)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=2e-3)
    (w,) = be._wrappers.values()
    assert isinstance(w, _FakeDecode) and w.use_tensor_cores  # GQA group 8


def test_backend_float32_falls_back(fake_flashinfer):
    be = fake_flashinfer
    meta, q, kc, vc = _step_inputs([3, 1], [20, 9], 2, 2, 16, torch.float32, 6)
    out = be.forward(q, kc, vc, meta, 0.25, 4, None)
    ref = A.TorchBackend().forward(q, kc, vc, meta, 0.25, 4)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert not be._wrappers and be._fallback.name in ("triton", "torch")

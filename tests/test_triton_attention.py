"""ops.triton_attention vs a plain torch reference, run on the CPU through the Triton interpreter."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import

import pytest
import torch

pytest.importorskip("triton")

from ops import triton_attention as ta
from tests.attention_ref import BLOCK_SIZE, make_batch, ref_paged_attention

# Mixed batch: decodes (q_len 1), chunked prefills with cached context (incl. lengths not multiple of 16),
# a fresh prefill with 0 prior context, and a 1-token sequence with no context.
Q_LENS = [1, 7, 1, 20, 5, 1]
KV_LENS = [37, 30, 16, 20, 53, 1]


def _check(out, ref, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


CASES = [
    # group, head_dim, sliding_window, softcap, dtype
    (1, 64, None, None, torch.float32),
    (3, 80, None, None, torch.float32),
    (4, 64, 8, None, torch.float32),
    (1, 80, 17, 30.0, torch.float32),
    (3, 64, None, 5.0, torch.float32),
    (4, 80, 24, 20.0, torch.float32),
    (4, 64, None, None, torch.bfloat16),
    (3, 80, 8, 30.0, torch.bfloat16),
    (1, 80, 9, None, torch.float16),
]


@pytest.mark.parametrize("group,head_dim,window,softcap,dtype", CASES)
def test_paged_attention_mixed_batch(group, head_dim, window, softcap, dtype):
    q, kc, vc, cu, sl, bt = make_batch(Q_LENS, KV_LENS, 2, group, head_dim, dtype, seed=group * 100 + head_dim)
    scale = head_dim ** -0.5
    out = ta.paged_attention(q, kc, vc, cu, sl, bt, scale, sliding_window=window, softcap=softcap,
                             max_seqlen_q=max(Q_LENS))
    assert out.shape == q.shape and out.dtype == dtype
    ref = ref_paged_attention(q, kc, vc, cu, sl, bt, scale, window, softcap)
    _check(out, ref, dtype)


@pytest.mark.parametrize("window", [None, 13])
def test_small_tiles_exercise_unmasked_path_and_multiple_q_tiles(window):
    # BLOCK_N=16 / BLOCK_M=16 so short contexts produce several KV tiles fully inside the causal/window range
    # (the unmasked loop) and prefills span several query tiles.
    q_lens, kv_lens = [1, 19, 1, 33], [70, 50, 5, 40]
    q, kc, vc, cu, sl, bt = make_batch(q_lens, kv_lens, 1, 4, 64, torch.float32, seed=7)
    out = ta._paged_attention_impl(q, kc, vc, cu, sl, bt, 0.125, sliding_window=window, block_m=16, block_n=16)
    ref = ref_paged_attention(q, kc, vc, cu, sl, bt, 0.125, window)
    _check(out, ref, torch.float32)


@pytest.mark.parametrize("num_segments,window,dtype", [(4, None, torch.float32), (8, 20, torch.float32),
                                                       (4, None, torch.bfloat16)])
def test_split_kv_decode(num_segments, window, dtype):
    # Flash-decoding path: KV range split into segments (some empty) merged by the reduce kernel.
    q_lens, kv_lens = [1, 1, 1, 1], [100, 1, 17, 64]
    q, kc, vc, cu, sl, bt = make_batch(q_lens, kv_lens, 2, 3, 80, dtype, seed=11)
    out = ta._paged_attention_impl(q, kc, vc, cu, sl, bt, 0.1, sliding_window=window, softcap=None,
                                   max_seqlen_q=1, block_n=16, num_segments=num_segments)
    ref = ref_paged_attention(q, kc, vc, cu, sl, bt, 0.1, window)
    _check(out, ref, dtype)


def test_block_size_larger_than_kv_tile():
    # block_size 32 with 16-position KV tiles: a tile covers half a cache block.
    q, kc, vc, cu, sl, bt = make_batch([3, 1, 12], [45, 70, 12], 2, 2, 64, torch.float32, seed=9, block_size=32)
    out = ta._paged_attention_impl(q, kc, vc, cu, sl, bt, 0.125, sliding_window=20, block_m=16, block_n=16)
    ref = ref_paged_attention(q, kc, vc, cu, sl, bt, 0.125, 20)
    _check(out, ref, torch.float32)


def test_split_kv_mixed_batch():
    # Splitting is generic: it must also be exact for prefill tiles.
    q, kc, vc, cu, sl, bt = make_batch(Q_LENS, KV_LENS, 2, 1, 64, torch.float32, seed=3)
    out = ta._paged_attention_impl(q, kc, vc, cu, sl, bt, 0.125, sliding_window=10, softcap=10.0,
                                   block_m=16, block_n=16, num_segments=2)
    ref = ref_paged_attention(q, kc, vc, cu, sl, bt, 0.125, 10, 10.0)
    _check(out, ref, torch.float32)


def test_decode_only_default_tiling_and_noncontiguous_q():
    q_lens, kv_lens = [1, 1, 1], [33, 2, 48]
    q, kc, vc, cu, sl, bt = make_batch(q_lens, kv_lens, 2, 4, 64, torch.float32, seed=5)
    # q as a strided view of a fused qkv-like buffer
    big = torch.randn(q.shape[0], q.shape[1] + 3, q.shape[2])
    big[:, 1:1 + q.shape[1]] = q
    qv = big[:, 1:1 + q.shape[1]]
    assert not qv.is_contiguous()
    out = ta.paged_attention(qv, kc, vc, cu, sl, bt, 0.125)  # max_seqlen_q None: inferred decode-only
    ref = ref_paged_attention(q, kc, vc, cu, sl, bt, 0.125)
    _check(out, ref, torch.float32)


def test_empty_batch():
    q = torch.empty(0, 4, 64)
    kc = torch.zeros(2, BLOCK_SIZE, 2, 64)
    out = ta.paged_attention(q, kc, kc.clone(), torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                             torch.zeros(0, 1, dtype=torch.int32), 0.125)
    assert out.shape == (0, 4, 64)


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 80), (torch.bfloat16, 64)])
def test_store_kv(dtype, head_dim):
    g = torch.Generator().manual_seed(1)
    num_blocks, hkv, t = 6, 3, 9
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, hkv, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(t, hkv, head_dim, generator=g).to(dtype)
    v = torch.randn(t, hkv, head_dim, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=g)[:t].long()
    slots[2] = -1  # padding token: skipped
    slots[6] = -1
    ta.store_kv(k, v, k_cache, v_cache, slots)

    k_ref = torch.zeros_like(k_cache)
    v_ref = torch.zeros_like(v_cache)
    keep = slots >= 0
    s = slots[keep]
    k_ref.view(-1, hkv, head_dim)[s] = k[keep]
    v_ref.view(-1, hkv, head_dim)[s] = v[keep]
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


def test_store_then_attend_roundtrip():
    # Write a prefill's K/V through store_kv, then attend: equals plain causal attention.
    g = torch.Generator().manual_seed(2)
    hkv, group, d, n = 2, 2, 64, 21
    k = torch.randn(n, hkv, d, generator=g)
    v = torch.randn(n, hkv, d, generator=g)
    q = torch.randn(n, hkv * group, d, generator=g)
    k_cache = torch.zeros(4, BLOCK_SIZE, hkv, d)
    v_cache = torch.zeros_like(k_cache)
    bt = torch.tensor([[3, 1]], dtype=torch.int32)
    pos = torch.arange(n)
    slots = bt[0].long()[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    ta.store_kv(k, v, k_cache, v_cache, slots)
    cu = torch.tensor([0, n], dtype=torch.int32)
    sl = torch.tensor([n], dtype=torch.int32)
    out = ta.paged_attention(q, k_cache, v_cache, cu, sl, bt, d ** -0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1), v.repeat_interleave(group, 1).transpose(0, 1),
        is_causal=True).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)

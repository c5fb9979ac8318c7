"""Triton kernels for the paged KV cache: ``store_kv`` and ``paged_attention``.

Cache layout, per layer: ``k_cache`` / ``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``.
KV position ``p`` of sequence ``b`` lives at block ``block_tables[b, p // block_size]``, offset
``p % block_size``.  A cache may be fp8 (ops/kv_quant.py): ``store_kv`` then quantizes each head vector with its
own scale, stored in the cache's ``kv_scale`` tensor, and attention applies the scales to the scores (K) and
to the probabilities (V), so no dequantized copy of a tile is made.  A turbo cache (ops/turbo_quant.py) holds
packed codes: attention unpacks them to their codebook levels as it loads a tile, its lengths act as scales,
and q arrives in its rotated frame (the backend rotates q in and the output back).

``paged_attention`` runs one unified kernel over a flat, mixed batch (decodes and chunked prefills):

* The grid's first axis enumerates query tiles.  Each sequence gets ``cu_q[b+1]//BLOCK_Q - cu_q[b]//BLOCK_Q + 1``
  consecutive tile slots (an upper bound on ``ceil(q_len/BLOCK_Q)``), so the grid size
  ``num_tokens // BLOCK_Q + num_seqs`` depends only on tensor shapes (no host sync, CUDA-graph friendly); a
  program finds its sequence by binary search over ``cu_seqlens_q`` and exits when its slot is unused.
* The second axis is the KV head.  The tile's M dimension packs ``BLOCK_Q`` query tokens x the ``GROUP`` query
  heads sharing that KV head (GQA), so each K/V tile is loaded once per group (decode-friendly).
* Online softmax (exp2 domain, fp32 accumulation) over KV tiles of ``BLOCK_N`` positions.  Only the KV tiles that
  intersect the causal / sliding window of the query tile are visited, and tiles that lie fully inside every
  row's window run without the causal/window mask.
* head_dim is padded to a power of two with masks (64, 80, 96, 128, 256, ...).
* Optional third axis: split-KV ("flash decoding") when the 2D grid is too small to fill the GPU (small decode
  batches with long contexts); a small reduce kernel merges the partial (max, sum, acc) triples.

Sliding window follows transformers' ``sliding_window_overlay``: a query at position t sees kv positions
``t - W < p <= t``.  Softcap: ``scores = softcap * tanh(scores / softcap)`` applied after ``scale``.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl
from ops import envs

__all__ = ["store_kv", "paged_attention"]



def _interpreter_needs_fp32_dot(dtype: torch.dtype) -> bool:
    # The Triton interpreter stores bf16 as uint16 and its tl.dot runs np.matmul on the raw bits, so under
    # TRITON_INTERPRET=1 bf16 operands are upcast (exact) before the dot.  Compiled kernels use native dots.
    return dtype == torch.bfloat16 and envs.triton_interpret()


# ----------------------------------------------------------------------------------------------------------------------
# store_kv
# ----------------------------------------------------------------------------------------------------------------------


@triton.jit
def _fp8_round(x, EMIN: tl.constexpr, MBITS: tl.constexpr):
    """x (fp32, within fp8's range) rounded to nearest-even on fp8's grid, so the cast after it is exact
    (the interpreter's own rounding carries wrongly into the exponent): adding and taking away 1.5 * 2^23
    grid steps at x's exponent (fixed below the smallest normal, EMIN) rounds in fp32."""
    e = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    big = (((tl.maximum(e, EMIN) - MBITS + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (x + big) - big
    return tl.where(r == 0.0, x * 0.0, r)  # what rounds to zero keeps its sign


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr,
    num_kv_heads,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    stride_sb, stride_ss, stride_sh,
    HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_EMIN: tl.constexpr, FP8_MBITS: tl.constexpr,
):
    """FP8_MAX > 0: fp8 caches, each head vector scaled by its own max |value| / FP8_MAX (ops/kv_quant.py)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask,
                other=0.0)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask,
                other=0.0)
    kc = kc_ptr + blk * stride_kcb + off * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd
    vc = vc_ptr + blk * stride_vcb + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd
    if FP8_MAX > 0:
        h_mask = offs_h < num_kv_heads
        s_off = blk * stride_sb + off * stride_ss + offs_h * stride_sh
        k_amax = tl.max(tl.abs(k.to(tl.float32)), 1)
        v_amax = tl.max(tl.abs(v.to(tl.float32)), 1)
        k_scale = tl.where(k_amax > 0, k_amax / FP8_MAX, 1.0)
        v_scale = tl.where(v_amax > 0, v_amax / FP8_MAX, 1.0)
        k = _fp8_round(tl.minimum(tl.maximum(k.to(tl.float32) / k_scale[:, None], -FP8_MAX), FP8_MAX),
                       FP8_EMIN, FP8_MBITS)
        v = _fp8_round(tl.minimum(tl.maximum(v.to(tl.float32) / v_scale[:, None], -FP8_MAX), FP8_MAX),
                       FP8_EMIN, FP8_MBITS)
        tl.store(ks_ptr + s_off, k_scale, mask=h_mask)
        tl.store(vs_ptr + s_off, v_scale, mask=h_mask)
    tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)


def _scales(k_cache, v_cache):
    """The fp8 caches' scale tensors (ops/kv_quant.py); the caches themselves stand in where there are none."""
    ks, vs = getattr(k_cache, "kv_scale", None), getattr(v_cache, "kv_scale", None)
    return (k_cache, v_cache) if ks is None else (ks, vs)


def _scale_strides(k_cache):
    ks = getattr(k_cache, "kv_scale", None)
    return (0, 0, 0) if ks is None else ks.stride()


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter ``k``/``v`` ``[T, Hkv, D]`` into the paged caches at ``slot_mapping`` (``block*block_size+offset``).

    Slots < 0 (padding tokens) are skipped.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} shapes differ")
    if k_cache.dim() != 4 or k_cache.shape[2:] != (num_kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache shape {tuple(k_cache.shape)} / {tuple(v_cache.shape)} does not match "
                         f"[num_blocks, block_size, {num_kv_heads}, {head_dim}]")
    if slot_mapping.numel() != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.numel()} entries for {num_tokens} tokens")
    if num_tokens == 0:
        return
    block_size = k_cache.shape[1]
    ks, vs = _scales(k_cache, v_cache)
    e4m3 = k_cache.dtype == torch.float8_e4m3fn
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, ks, vs, slot_mapping,
        num_kv_heads,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(), *_scale_strides(k_cache),
        HEAD_DIM=head_dim, H_PAD=triton.next_power_of_2(num_kv_heads), D_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, FP8_MAX=torch.finfo(k_cache.dtype).max if ks is not k_cache else 0.0,
        FP8_EMIN=-6 if e4m3 else -14, FP8_MBITS=3 if e4m3 else 2,
        num_warps=1 if num_kv_heads * head_dim <= 1024 else 4,
    )


# ----------------------------------------------------------------------------------------------------------------------
# paged attention
# ----------------------------------------------------------------------------------------------------------------------


@triton.jit
def _find_seq_idx(cu_q_ptr, tile_id, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest b with cu_q[b] // BLOCK_Q + b <= tile_id (the sequence owning this tile slot)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid
        if start <= tile_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    # Portable tanh (compiled and interpreter), clamped so exp never overflows.
    x = tl.minimum(tl.maximum(x, -15.0), 15.0)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _turbo_values(base, d, mask, lv_ptr, BITS: tl.constexpr):
    """A turbo cache's codebook levels for value d of the rows at `base` (ops/turbo_quant.py: eight values
    are a little-endian word of 8 * BITS bits); their lengths come in as the rows' scales."""
    bit = d * BITS
    word = tl.load(base + bit // 8, mask=mask, other=0).to(tl.int32)
    if BITS == 3:  # a code that straddles two bytes
        word = word | (tl.load(base + bit // 8 + 1, mask=mask & (bit % 8 > 5), other=0).to(tl.int32) << 8)
    return tl.load(lv_ptr + ((word >> (bit % 8)) & ((1 << BITS) - 1)), mask=mask, other=0.0)


@triton.jit
def _attn_tiles(
    acc, l_i, m_i,
    q, q_pos,
    k_cache_ptr, v_cache_ptr, ks_ptr, vs_ptr, lv_ptr, bt_row_ptr, kvh, seq_len, window,
    scale, softcap,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_sb, stride_ss, stride_sh,
    offs_d, d_mask,
    tile_start, tile_end,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAD_D: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, MASKED: tl.constexpr, FP32: tl.constexpr,
    UPCAST_DOT: tl.constexpr, SCALED: tl.constexpr, TURBO: tl.constexpr,
):
    """Online-softmax over KV tiles [tile_start, tile_end).  MASKED=False: every position of every tile is inside
    the causal/window range of every row and below seq_len, so no score mask and no position bounds on loads.
    SCALED: fp8 and turbo caches; a position's K scale multiplies its scores, its V scale its probabilities.
    TURBO: a turbo cache's bits a value (0: none); its rows are packed codes, read as levels (lv_ptr)."""
    offs_n = tl.arange(0, BLOCK_N)
    for t in range(tile_start, tile_end):
        kv_pos = t * BLOCK_N + offs_n
        if MASKED:
            n_valid = kv_pos < seq_len
            blk = tl.load(bt_row_ptr + kv_pos // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row_ptr + kv_pos // BLOCK_SIZE).to(tl.int64)
        off = kv_pos % BLOCK_SIZE
        k_rows = k_cache_ptr + blk[None, :] * stride_kb + off[None, :] * stride_ks + kvh * stride_kh
        v_rows = v_cache_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vs + kvh * stride_vh
        k_ptrs = k_rows + offs_d[:, None] * stride_kd
        v_ptrs = v_rows + offs_d[None, :] * stride_vd
        if TURBO:
            if MASKED:
                k_mask = d_mask[:, None] & n_valid[None, :]
                v_mask = n_valid[:, None] & d_mask[None, :]
            else:
                k_mask = d_mask[:, None] & (offs_n[None, :] >= 0)
                v_mask = (offs_n[:, None] >= 0) & d_mask[None, :]
            k = _turbo_values(k_rows, offs_d[:, None], k_mask, lv_ptr, TURBO)
            v = _turbo_values(v_rows, offs_d[None, :], v_mask, lv_ptr, TURBO)
        elif MASKED:
            k = tl.load(k_ptrs, mask=d_mask[:, None] & n_valid[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=n_valid[:, None] & d_mask[None, :], other=0.0)
        elif PAD_D:
            k = tl.load(k_ptrs, mask=d_mask[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if SCALED:
            s_ptrs = blk * stride_sb + off * stride_ss + kvh * stride_sh
            if MASKED:
                k_scale = tl.load(ks_ptr + s_ptrs, mask=n_valid, other=0.0).to(tl.float32)
                v_scale = tl.load(vs_ptr + s_ptrs, mask=n_valid, other=0.0).to(tl.float32)
            else:
                k_scale = tl.load(ks_ptr + s_ptrs).to(tl.float32)
                v_scale = tl.load(vs_ptr + s_ptrs).to(tl.float32)

        if FP32:
            s = tl.dot(q, k.to(q.dtype), input_precision="ieee")
        elif UPCAST_DOT:
            s = tl.dot(q.to(tl.float32), k.to(q.dtype).to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k.to(q.dtype))
        s = s * scale
        if SCALED:
            s = s * k_scale[None, :]
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        s = s * 1.4426950408889634  # log2(e): softmax in the exp2 domain
        if MASKED:
            keep = (kv_pos[None, :] <= q_pos[:, None]) & n_valid[None, :]
            if USE_WINDOW:
                keep = keep & (kv_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(keep, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with nothing visible yet keep m = -inf; use 0 as the reference so exp2 gives 0, not NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        if SCALED:
            p = p * v_scale[None, :]
        if FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        elif UPCAST_DOT:
            pv = tl.dot(p.to(q.dtype).to(tl.float32), v.to(q.dtype).to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, l_i, m_i


# A step's sequence count and block-table width change from step to step: specialised (== 1,
# multiple of 16), each new pair would compile another variant in the middle of serving.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, ks_ptr, vs_ptr, lv_ptr, out_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,
    cu_q_ptr, seq_lens_ptr, bt_ptr,
    scale, softcap, window,
    num_seqs, num_q_heads,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_sb, stride_ss, stride_sh,
    stride_ot, stride_oh, stride_od,
    stride_bt,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, FP32: tl.constexpr,
    UPCAST_DOT: tl.constexpr, PAD_D: tl.constexpr, SCALED: tl.constexpr, TURBO: tl.constexpr,
):
    tile_id = tl.program_id(0)
    kvh = tl.program_id(1)
    seg = tl.program_id(2)

    b = _find_seq_idx(cu_q_ptr, tile_id, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    tok0 = (tile_id - (q_start // BLOCK_Q + b)) * BLOCK_Q
    if tok0 >= q_len:
        return  # unused tile slot
    seq_len = tl.load(seq_lens_ptr + b)
    ctx_len = seq_len - q_len

    # Rows of the tile: BLOCK_Q tokens x GROUP q heads of this kv head (row = token * GROUP + head_in_group).
    offs_m = tl.arange(0, BLOCK_M)
    tok = tok0 + offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    row_valid = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = ctx_len + tok
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    row = (q_start + tok).to(tl.int64)

    q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)

    # KV tiles this query tile can see: [tile_lo, tile_hi); [full_lo, full_hi) need no mask.
    pos_first = ctx_len + tok0
    pos_last = ctx_len + tl.minimum(tok0 + BLOCK_Q, q_len) - 1
    tile_hi = (pos_last + BLOCK_N) // BLOCK_N
    full_hi = (pos_first + 1) // BLOCK_N
    if USE_WINDOW:
        tile_lo = tl.maximum(pos_first - window + 1, 0) // BLOCK_N
        x = pos_last - window  # tile t is inside every row's window iff t * BLOCK_N > x
        full_lo = tl.where(x < 0, 0, tl.maximum(x, 0) // BLOCK_N + 1)
        full_lo = tl.maximum(full_lo, tile_lo)
    else:
        tile_lo = 0
        full_lo = 0
    full_hi = tl.maximum(tl.minimum(full_hi, tile_hi), full_lo)

    if NUM_SEGMENTS > 1:
        per_seg = (tile_hi - tile_lo + NUM_SEGMENTS - 1) // NUM_SEGMENTS
        seg_lo = tl.minimum(tile_lo + seg * per_seg, tile_hi)
        seg_hi = tl.minimum(seg_lo + per_seg, tile_hi)
    else:
        seg_lo = tile_lo
        seg_hi = tile_hi

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_bt

    acc, l_i, m_i = _attn_tiles(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, ks_ptr, vs_ptr, lv_ptr, bt_row_ptr, kvh, seq_len, window,
        scale,
        softcap, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
        stride_sb, stride_ss, stride_sh,
        offs_d, d_mask, seg_lo, tl.minimum(seg_hi, full_lo),
        BLOCK_N, BLOCK_SIZE, PAD_D, USE_WINDOW, USE_SOFTCAP, True, FP32, UPCAST_DOT, SCALED, TURBO)
    acc, l_i, m_i = _attn_tiles(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, ks_ptr, vs_ptr, lv_ptr, bt_row_ptr, kvh, seq_len, window,
        scale,
        softcap, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
        stride_sb, stride_ss, stride_sh,
        offs_d, d_mask, tl.maximum(seg_lo, full_lo), tl.minimum(seg_hi, full_hi),
        BLOCK_N, BLOCK_SIZE, PAD_D, USE_WINDOW, USE_SOFTCAP, False, FP32, UPCAST_DOT, SCALED, TURBO)
    acc, l_i, m_i = _attn_tiles(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, ks_ptr, vs_ptr, lv_ptr, bt_row_ptr, kvh, seq_len, window,
        scale,
        softcap, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
        stride_sb, stride_ss, stride_sh,
        offs_d, d_mask, tl.maximum(seg_lo, full_hi), seg_hi,
        BLOCK_N, BLOCK_SIZE, PAD_D, USE_WINDOW, USE_SOFTCAP, True, FP32, UPCAST_DOT, SCALED, TURBO)

    if NUM_SEGMENTS > 1:
        # Partials [T, Hq, S] (+ [D_PAD]) in fp32; the reduce kernel merges the segments.
        pidx = (row * num_q_heads + head) * NUM_SEGMENTS + seg
        tl.store(part_m_ptr + pidx, m_i, mask=row_valid)
        tl.store(part_l_ptr + pidx, l_i, mask=row_valid)
        tl.store(part_acc_ptr + pidx[:, None] * D_PAD + offs_d[None, :], acc, mask=row_valid[:, None])
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])


@triton.jit
def _reduce_segments_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    num_q_heads,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, D_PAD)
    base = (t * num_q_heads + h) * NUM_SEGMENTS + offs_s
    m = tl.load(part_m_ptr + base)
    l = tl.load(part_l_ptr + base)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    l_tot = tl.sum(w * l, 0)
    l_tot = tl.where(l_tot == 0.0, 1.0, l_tot)
    acc = tl.load(part_acc_ptr + base[:, None] * D_PAD + offs_d[None, :])
    out = tl.sum(acc * w[:, None], 0) / l_tot
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(idx).multi_processor_count


def _paged_attention_impl(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                          sliding_window=None, softcap=None, max_seqlen_q=None,
                          block_m=None, block_n=None, num_segments=None):
    """``paged_attention`` with optional tile / split-KV overrides (used by tests and benchmarks)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got {tuple(q.shape)}")
    num_tokens, num_q_heads, head_dim = q.shape
    bits, _, levels = getattr(k_cache, "kv_turbo", (0, None, None))  # q and out in a turbo cache's rotated frame
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[3] != head_dim * (bits or 8) // 8:
        raise ValueError(f"cache shape {tuple(k_cache.shape)} / {tuple(v_cache.shape)} does not match "
                         f"[num_blocks, block_size, num_kv_heads, {head_dim}]")
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    num_seqs = seq_lens.shape[0]
    if cu_seqlens_q.shape[0] != num_seqs + 1 or block_tables.shape[0] < num_seqs:
        raise ValueError("cu_seqlens_q must have num_seqs + 1 entries and block_tables num_seqs rows")
    if sliding_window is not None and sliding_window <= 0:
        sliding_window = None
    if softcap is not None and softcap <= 0:
        softcap = None

    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_q_heads // num_kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))
    decode_only = max_seqlen_q == 1 if max_seqlen_q is not None else num_tokens == num_seqs
    if block_m is None:
        # Decode: one token x the GQA group per tile; prefill: a tile of query rows.
        block_m = 16 if decode_only else (64 if d_pad <= 128 else 32)
    block_m = max(block_m, 16, triton.next_power_of_2(group))
    block_q = block_m // group
    if block_n is None:
        block_n = 64 if d_pad <= 128 else 32
    on_gpu = q.device.type == "cuda"

    num_tiles = num_tokens // block_q + num_seqs
    if num_segments is None:
        num_segments = 1
        sms = _sm_count(q.device)
        programs = num_tiles * num_kv_heads
        if decode_only and sms and programs < sms:
            # Small decode batch: split the KV range so the grid fills the GPU (flash decoding).
            num_segments = min(16, triton.next_power_of_2(triton.cdiv(2 * sms, programs)))
    num_segments = triton.next_power_of_2(max(1, int(num_segments)))

    if num_segments > 1:
        part_m = torch.empty((num_tokens, num_q_heads, num_segments), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_tokens, num_q_heads, num_segments, d_pad), dtype=torch.float32,
                               device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused

    fp32 = q.dtype == torch.float32
    if on_gpu:
        num_warps = 4 if block_m * d_pad <= 64 * 128 else 8
        num_stages = 3 if d_pad <= 128 else 2
    else:
        num_warps, num_stages = 4, 1
    ks, vs = _scales(k_cache, v_cache)
    _paged_attn_kernel[(num_tiles, num_kv_heads, num_segments)](
        q, k_cache, v_cache, ks, vs, k_cache if levels is None else levels, out,
        part_m, part_l, part_acc,
        cu_seqlens_q, seq_lens, block_tables,
        float(scale), float(softcap) if softcap is not None else 1.0,
        int(sliding_window) if sliding_window is not None else 0,
        num_seqs, num_q_heads,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *_scale_strides(k_cache), *out.stride(),
        block_tables.stride(0),
        HEAD_DIM=head_dim, D_PAD=d_pad, GROUP=group,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        NUM_SEGMENTS=num_segments, USE_WINDOW=sliding_window is not None, USE_SOFTCAP=softcap is not None,
        FP32=fp32, UPCAST_DOT=not fp32 and _interpreter_needs_fp32_dot(q.dtype),
        PAD_D=d_pad != head_dim, SCALED=ks is not k_cache, TURBO=bits,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_segments > 1:
        _reduce_segments_kernel[(num_tokens, num_q_heads)](
            out, part_m, part_l, part_acc, num_q_heads, *out.stride(),
            HEAD_DIM=head_dim, D_PAD=d_pad, NUM_SEGMENTS=num_segments,
            num_warps=4 if d_pad >= 128 else 1,
        )
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                    sliding_window: int | None = None, softcap: float | None = None,
                    max_seqlen_q: int | None = None) -> torch.Tensor:
    """Causal attention of a flat mixed batch of query tokens against the paged KV cache.

    q ``[T, Hq, D]``; sequence b owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and has ``seq_lens[b]`` KV
    positions in the cache (this step's tokens included).  ``block_tables [B, max_blocks]`` maps KV block index to
    cache block.  ``sliding_window`` W: position t sees ``t - W < p <= t``.  ``softcap``: tanh logit capping.
    ``max_seqlen_q`` is only a tiling hint (1 = decode-only batch); no host synchronisation is done.
    Returns ``[T, Hq, D]`` in q's dtype.
    """
    return _paged_attention_impl(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                                 sliding_window=sliding_window, softcap=softcap, max_seqlen_q=max_seqlen_q)

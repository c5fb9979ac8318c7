"""Paged-attention test inputs and a plain reference, shared by the interpreter tests
(tests/test_triton_attention.py) and the CUDA ones (tests/test_cuda.py); no environment set here."""
import torch

BLOCK_SIZE = 16


def ref_paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                        sliding_window=None, softcap=None):
    """Gather each sequence's K/V from the paged cache, build the explicit mask, softmax in fp64."""
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_cache.shape[2]
    bs = k_cache.shape[1]
    for b in range(seq_lens.shape[0]):
        s, e = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        q_len, kv_len = e - s, int(seq_lens[b])
        if q_len == 0:
            continue
        pos = torch.arange(kv_len)
        blocks = block_tables[b].long()[pos // bs]
        k = k_cache[blocks, pos % bs].double().repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
        v = v_cache[blocks, pos % bs].double().repeat_interleave(hq // hkv, dim=1)
        qb = q[s:e].double()
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
        kv_pos = pos[None, :]
        mask = kv_pos <= q_pos
        if sliding_window is not None:
            mask &= kv_pos > q_pos - sliding_window  # transformers' sliding_window_overlay
        scores = scores.masked_fill(~mask, float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return out


def make_batch(q_lens, kv_lens, num_kv_heads, group, head_dim, dtype, seed=0, extra_blocks=5,
               block_size=BLOCK_SIZE):
    """Random q and paged caches; each sequence's blocks are scattered over a shuffled pool."""
    g = torch.Generator().manual_seed(seed)
    num_q_heads = num_kv_heads * group
    blocks_per_seq = [-(-n // block_size) for n in kv_lens]
    max_blocks = max(blocks_per_seq) + 1
    num_blocks = sum(blocks_per_seq) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = torch.full((len(q_lens), max_blocks), -1, dtype=torch.int32)  # garbage past the end
    used = 0
    for b, nb in enumerate(blocks_per_seq):
        block_tables[b, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=g).to(dtype)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32)
    return q, k_cache, v_cache, cu, seq_lens, block_tables

"""FlashInferBackend vs TorchBackend on random paged batches. Needs a CUDA GPU and flashinfer."""
import importlib.util

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("FlashInfer GPU test: no CUDA device", allow_module_level=True)
if importlib.util.find_spec("flashinfer") is None:
    pytest.skip("FlashInfer GPU test: flashinfer is not installed (pip install flashinfer-python)",
                allow_module_level=True)

from ops import attention as A  # noqa: E402
from ops.backends import get_backend  # noqa: E402
from ops.flashinfer_attention import FlashInferBackend  # noqa: E402
from tests.test_flashinfer_metadata import make_meta  # noqa: E402

DEV = torch.device("cuda")
BS = 16
Q_LENS = [1, 7, 1, 20, 5, 1, 16, 64]
KV_LENS = [37, 30, 16, 20, 53, 1, 32, 300]


def inputs(q_lens, kv_lens, hq, hkv, d, dtype, seed):
    meta, num_blocks = make_meta(q_lens, kv_lens, bs=BS, seed=seed)
    meta = A.AttnMetadata(cu_seqlens_q=meta.cu_seqlens_q.to(DEV), seq_lens=meta.seq_lens.to(DEV),
                          block_tables=meta.block_tables.to(DEV), slot_mapping=meta.slot_mapping.to(DEV),
                          query_lens=meta.query_lens, kv_lens=meta.kv_lens, block_size=BS)
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(sum(q_lens), hq, d, generator=g, device=DEV).to(dtype)
    kc = torch.randn(num_blocks, BS, hkv, d, generator=g, device=DEV).to(dtype)
    vc = torch.randn(num_blocks, BS, hkv, d, generator=g, device=DEV).to(dtype)
    return meta, q, kc, vc


def check(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = 2e-2 if ref.dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


CASES = [
    # hq, hkv, head_dim, window, softcap, dtype
    (4, 4, 64, None, None, torch.float16),
    (8, 2, 128, None, None, torch.bfloat16),
    (8, 2, 128, 8, None, torch.float16),
    (16, 2, 64, 17, 30.0, torch.bfloat16),
    (6, 2, 128, None, 50.0, torch.float16),
    (8, 1, 256, 40, 30.0, torch.bfloat16),
]


@pytest.mark.parametrize("decode_only", [False, True])
@pytest.mark.parametrize("hq,hkv,d,window,softcap,dtype", CASES)
def test_matches_torch_backend(hq, hkv, d, window, softcap, dtype, decode_only):
    q_lens = [1] * len(KV_LENS) if decode_only else Q_LENS
    meta, q, kc, vc = inputs(q_lens, KV_LENS, hq, hkv, d, dtype, seed=hq * 1000 + d)
    scale = d ** -0.5
    out = FlashInferBackend().forward(q, kc, vc, meta, scale, window, softcap)
    check(out, A.TorchBackend().forward(q, kc, vc, meta, scale, window, softcap))


def test_interleaved_variants_and_steps():
    # sliding/full layers alternate within a step (separate wrappers and plans), then a new step re-plans
    be, ref = FlashInferBackend(), A.TorchBackend()
    for seed, q_lens in ((1, Q_LENS), (2, [1] * len(KV_LENS)), (3, Q_LENS)):
        meta, q, kc, vc = inputs(q_lens, KV_LENS, 8, 4, 128, torch.bfloat16, seed)
        for window, cap in [(16, 30.0), (None, 30.0), (16, 30.0), (None, 30.0)]:
            check(be.forward(q, kc, vc, meta, 0.1, window, cap), ref.forward(q, kc, vc, meta, 0.1, window, cap))


def test_store_then_attend_and_auto_choice():
    be = get_backend("auto", DEV)
    assert be.name == "flashinfer"
    meta, q, kc, vc = inputs(Q_LENS, KV_LENS, 8, 2, 64, torch.float16, seed=9)
    k_new = torch.randn(len(meta.slot_mapping), 2, 64, device=DEV, dtype=torch.float16)
    v_new = torch.randn_like(k_new)
    kc2, vc2 = kc.clone(), vc.clone()
    be.store_kv(k_new, v_new, kc, vc, meta.slot_mapping)
    A.TorchBackend().store_kv(k_new, v_new, kc2, vc2, meta.slot_mapping)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    check(be.forward(q, kc, vc, meta, 0.125), A.TorchBackend().forward(q, kc, vc, meta, 0.125))

"""ops/triton_fused.py's kernels against the torch ops they replace, on the CPU through the Triton
interpreter; then whole models with the fused ops and the decode graphs against transformers."""
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import has_triton

pytestmark = pytest.mark.skipif(not has_triton(), reason="triton is not installed")

# bfloat16: a few units in the last place, as the interpreter truncates where a GPU rounds
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)]


@pytest.fixture
def triton_ops(monkeypatch):
    monkeypatch.setenv("XINFER_TRITON_OPS", "1")


def _torch_norm(x, residual, weight, eps, offset):
    """ops/norm.py's torch path, written out."""
    residual = x if residual is None else x + residual
    xf = residual.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (xf * (offset + weight.float())).to(x.dtype) if offset else weight * xf.to(x.dtype)
    return y, residual


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_add_rmsnorm(dtype, tol, offset):
    from ops import triton_fused as tfu
    g = torch.Generator().manual_seed(1)
    x, r = (torch.randn(5, 72, generator=g).to(dtype) for _ in range(2))
    w = (torch.randn(72, generator=g) * 0.3 + (0 if offset else 1)).to(dtype)
    want, want_sum = _torch_norm(x, r, w, 1e-6, offset)
    got_r = r.clone()
    got = tfu.add_rmsnorm(x, got_r, w, 1e-6, offset)
    # the sum is kept in the residual's dtype; the interpreter truncates to bfloat16 where a GPU (and
    # torch) rounds to nearest: one unit in the last place apart there
    ulp = 0 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got_r, want_sum, atol=0, rtol=ulp)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    heads = x.view(5, 2, 36)  # per-head norms (q_norm, k_norm) take any leading shape
    torch.testing.assert_close(tfu.add_rmsnorm(heads, None, w[:36], 1e-6, offset),
                               _torch_norm(heads, None, w[:36], 1e-6, offset)[0], atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("gelu", [False, True])
def test_gated_act(dtype, tol, gelu):
    from ops import triton_fused as tfu
    x = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(2)).to(dtype) * 3
    gate, up = x.chunk(2, dim=-1)
    want = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
    torch.testing.assert_close(tfu.gated_act(x, gelu), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("rot", [32, 16])
def test_rotary_in_place(dtype, tol, rot):
    from ops import triton_fused as tfu
    from ops.rotary import RotaryEmbedding, _apply
    emb = RotaryEmbedding(32, 64, 10000.0, rot_dim=rot)
    qkv = torch.randn(4, (3 + 1) * 32 + 7, generator=torch.Generator().manual_seed(3)).to(dtype)
    q = qkv[:, :96].view(4, 3, 32)  # strided rows, as views into the QKV projection's output
    pos = torch.tensor([0, 5, 17, 63])
    want = _apply(q, emb.cos[pos].unsqueeze(1), emb.sin[pos].unsqueeze(1), rot)
    tfu.rotary_(q, pos, emb.cos, emb.sin, rot)
    torch.testing.assert_close(q, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_models_with_fused_ops_and_graphs_match_transformers(name, tmp_path, triton_ops, monkeypatch):
    """Qwen3 (per-head q/k norms, SiLU) and Gemma 3 (offset norms, tanh-GELU, sliding windows):
    logits within 1e-4 of transformers with every norm, activation and rotary fused, the decode
    steps replayed through the graphs' CPU stand-in."""
    from tests.test_models import _check_logits, _make
    monkeypatch.setenv("XINFER_CPU_GRAPHS", "1")
    model = _make(name)
    model.save_pretrained(tmp_path)
    engine = _check_logits(name, str(tmp_path), model, backend="triton")
    assert engine.runner.graphs is not None and engine.runner.graphs.replays >= 6  # of 8 decode steps
    engine.close()

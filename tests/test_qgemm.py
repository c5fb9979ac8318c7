"""GGUF Q4_K / Q6_K / Q8_0 weights held once (ops/qgemm.py, ops/cpu_qgemm.c): the kernels against
llama.cpp's numerics (gguf-py's dequantization of the same blocks times the activations quantized to 8
bits with a scale per 32 values, ggml's quantize_row_q8_0), and a Q4_K_M-style model that holds no float copy and
stays within the fidelity budget of the exact float path."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from ops import qgemm
from xinfer.loader import kquant

pytestmark = pytest.mark.skipif(not qgemm.available(), reason="no AVX512-VNNI here (or XINFER_QGEMM=0): GGUF "
                                "weights keep the block kernels and a float copy, which test_gguf.py checks")

QUANT = {"Q4_K": lambda w: kquant.q4_k(w.reshape(-1, 256)), "Q6_K": lambda w: kquant.q6_k(w.reshape(-1, 256)),
         "Q8_0": lambda w: quantize(w, Q.Q8_0)}


def _weight(type_name, n, k, seed=0):
    w = (np.random.default_rng(seed).standard_normal((n, k)) * 0.05).astype(np.float32)
    b = QUANT[type_name](w).reshape(n, -1)
    return b, torch.from_numpy(dequantize(b, Q[type_name]).reshape(n, k).astype(np.float32))


def _q8(x: torch.Tensor) -> torch.Tensor:
    """x as ggml's Q8_0 quantizes activations: per 32 values, d = max |x| / 127, round to nearest."""
    xb = x.double().view(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    return (torch.round(xb / torch.where(d > 0, d, 1)) * d).view_as(x)


@pytest.mark.parametrize("type_name,n,k", [("Q4_K", 48, 512), ("Q6_K", 32, 768), ("Q8_0", 64, 96)])
def test_matmul_is_llama_cpp_arithmetic(type_name, n, k):
    """Every batch size (tiles of 6 rows and their remainders, chunks of 64) gives the reference up to
    float32 rounding of the block sums."""
    b, wd = _weight(type_name, n, k)
    pw = qgemm.PackedWeight.from_gguf(type_name, b, (n, k))
    for m in (1, 5, 6, 7, 13, 70):
        x = torch.randn(m, k)
        x[0, :7] = 0.0  # a block of zeros somewhere does no harm
        ref = _q8(x) @ wd.double().T
        y = pw(x)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6, (type_name, m)
        assert ((y - x @ wd.T).norm() / (x @ wd.T).norm()).item() < 0.02  # what the 8-bit activations cost


def test_fused_parts_and_rows():
    """A fused weight of parts in different types (Q4_K_M's Q6_K value rows beside Q4_K ones) writes each
    part's columns; rows() dequantizes a table's rows bit for bit as gguf does (embedding lookups)."""
    parts = [_weight(t, n, 512, seed=i) for i, (t, n) in enumerate([("Q4_K", 32), ("Q6_K", 16), ("Q8_0", 48)])]
    packed = [qgemm.PackedWeight.from_gguf(t, b, (n, 512)) for (b, _), (t, n) in zip(parts, [("Q4_K", 32), ("Q6_K", 16), ("Q8_0", 48)])]
    fused = qgemm.PackedWeight.cat(packed)
    assert fused.shape == (96, 512)
    x = torch.randn(9, 512)
    assert torch.equal(fused(x), torch.cat([p(x) for p in packed], dim=1))
    for p, (_, wd) in zip(packed, parts):
        ids = torch.tensor([[0, 17 % wd.shape[0]], [wd.shape[0] - 1, 5]])
        assert torch.equal(p.rows(ids), wd[ids])
    with pytest.raises(ValueError):
        fused.narrow(0, 0, 16)  # tensor parallel keeps ops/quant.py's blocks


def test_q4_k_m_model_holds_no_float_copy(tmp_path):
    """A Q4_K_M-style file (Q4_K matrices, Q6_K values, down projection and tied table) on the default
    fast path: every matrix and the embedding table are held as blocks only, the loader reads none of
    them in float, and the logits stay within the fidelity budget of the exact float32 path."""
    from tests.test_gguf import _byte_level_vocab, _dims, _write
    from xinfer import Engine, EngineConfig
    rng = np.random.default_rng(5)
    hidden, heads, kv, ff = 256, 4, 2, 512
    meta = _dims("qwen3", hidden, heads, kv, ff, layers=2) | _byte_level_vocab()
    meta["qwen3.attention.key_length"] = meta["qwen3.attention.value_length"] = 64
    vocab = len(meta["tokenizer.ggml.tokens"])
    vocab_pad = -(-vocab // 16) * 16
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"] + [f"<pad{i}>" for i in range(vocab_pad - vocab)]
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"] + [3] * (vocab_pad - vocab)
    small = lambda *s: (rng.standard_normal(s) * 0.05).astype(np.float32)  # noqa: E731
    tensors = {"token_embd.weight": (QUANT["Q6_K"](small(vocab_pad, hidden)).reshape(vocab_pad, -1), Q.Q6_K),
               "output_norm.weight": (np.ones(hidden, np.float32), Q.F32)}
    for i in range(2):
        tensors |= {f"blk.{i}.{n}.weight": (np.ones(d, np.float32), Q.F32) for n, d in
                    [("attn_norm", hidden), ("ffn_norm", hidden), ("attn_q_norm", 64), ("attn_k_norm", 64)]}
        for name, (n, k) in {"attn_q": (heads * 64, hidden), "attn_k": (kv * 64, hidden), "attn_v": (kv * 64, hidden),
                             "attn_output": (hidden, heads * 64), "ffn_gate": (ff, hidden), "ffn_up": (ff, hidden),
                             "ffn_down": (hidden, ff)}.items():
            t = "Q6_K" if name in ("attn_v", "ffn_down") and i == 0 else "Q8_0" if name == "attn_output" else "Q4_K"
            tensors[f"blk.{i}.{name}.weight"] = (QUANT[t](small(n, k)).reshape(n, -1), Q[t])
    path = tmp_path / "q4km.gguf"
    _write(path, "qwen3", meta, tensors)
    prompt = [int(t) for t in rng.integers(0, vocab, 40)]
    lps = {}
    for matmul in ("float32", "bfloat16"):
        e = Engine(EngineConfig(model=str(path), cpu_matmul=matmul, num_kv_blocks=32, block_size=4), log_level="warning")
        try:
            model = e.runner.model
            lins = [m for m in model.modules() if type(m).__name__ == "Linear"]
            if matmul == "bfloat16":
                assert all(isinstance(m.blocks, qgemm.PackedWeight) and m.weight.numel() == 0 and m.fast is None for m in lins)
                assert model.model.embed_tokens.weight.numel() == 0 and model.model.embed_tokens.blocks is model.head_blocks
                assert model.held_names >= {"model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight"}
            else:  # --cpu-matmul float32 stays exact: the block kernels beside the float weights
                assert not any(isinstance(m.blocks, qgemm.PackedWeight) for m in lins)
            lps[matmul] = e.runner.log_probs(prompt, chunk=7)
            if matmul == "bfloat16":  # the one-call C decode step reads the packed blocks too
                _c_step_matches(e, [prompt[:9], prompt[3:20]], 12)
        finally:
            e.close()
    _within_budget(lps["float32"], lps["bfloat16"])


def _c_step_matches(e, prompts, n):
    """Greedy tokens through the one-call C decode step equal the op-by-op step's."""
    from xinfer import SamplingParams
    model, runs = e.runner.model, []
    for fused in (None, False):
        model._cpu_decoder = fused
        runs.append(e.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
        assert (model._cpu_decoder is False) == (fused is False)
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]


def _within_budget(p, q):
    """The fast path's log-probabilities q against float32's p: mean KLD and same top token."""
    kld = (p.exp() * (p - q)).sum(-1).mean().item()
    same_top = (p.argmax(-1) == q.argmax(-1)).float().mean().item()
    assert kld < 0.002 and same_top >= 0.95, (kld, same_top)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_isq_holds_blocks_alone(tmp_path, monkeypatch, fmt):
    """--isq on the fast path: the Linears' and the head's blocks are held alone (their float weights
    freed; a tied table would stay for the embedding), within the fidelity budget of the exact float32
    path on the same blocks."""
    from tests.test_quantized import _llama
    from xinfer import Engine, EngineConfig
    monkeypatch.setenv("XINFER_CACHE_DIR", str(tmp_path / "cache"))
    _llama(hidden=256, inter=512, layers=2, vocab=256).save_pretrained(tmp_path / "m")
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 256, 48)]
    lps = {}
    for matmul in ("float32", "bfloat16"):
        e = Engine(EngineConfig(model=str(tmp_path / "m"), isq=fmt, cpu_matmul=matmul, num_kv_blocks=32, block_size=4),
                   log_level="warning")
        try:
            m = e.runner.model
            lins = [x for x in m.modules() if type(x).__name__ == "Linear" and x is not m.lm_head]
            held = matmul == "bfloat16"
            assert all(isinstance(x.blocks, qgemm.PackedWeight) == held for x in lins)
            assert isinstance(m.head_blocks, qgemm.PackedWeight) == held
            if held:
                assert all(x.weight.numel() == 0 and x.fast is None for x in lins) and m.lm_head.weight.numel() == 0
            lps[matmul] = e.runner.log_probs(prompt, chunk=5)
        finally:
            e.close()
    p, q = lps["float32"], lps["bfloat16"]
    kld = (p.exp() * (p - q)).sum(-1).mean().item()
    # a tiny random model has near ties: the mean KLD is the budget that matters
    assert kld < 0.002 and (p.argmax(-1) == q.argmax(-1)).float().mean().item() >= 0.9, kld


@pytest.mark.skipif(not qgemm.Bf16Weight.available(), reason="the kernels here lack AVX512_BF16 (the suite builds them below it; test_the_bf16_build_passes_its_tests reruns this with them where the CPU has it)")
def test_bf16_panels_every_batch_and_the_decode_step(tmp_path):
    """--cpu-matmul bfloat16 holds each Linear and the head once, as bfloat16 panels: the kernel is the
    bfloat16 GEMM's arithmetic (inputs and weights rounded to bfloat16, float32 sums) at every batch
    size and with fused parts; a bfloat16 checkpoint's matrices are packed as read (no float32 copy),
    the one-call C decode step reads the panels with the same tokens as the op-by-op path, and the
    logits stay within the budget of float32."""
    torch.manual_seed(0)
    parts = [torch.randn(n, 96) for n in (32, 16, 48)]
    w = qgemm.Bf16Weight.cat([qgemm.Bf16Weight.of(p) for p in parts])
    full, bias = torch.cat(parts), torch.randn(96)  # 96 outputs
    for m in (1, 5, 16, 17, 40):
        x = torch.randn(m, 96)
        ref = x.bfloat16().double() @ full.bfloat16().double().T
        torch.testing.assert_close(w(x).double(), ref, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(w(x, bias[:w.shape[0]]).double(), ref + bias[:w.shape[0]].double(), rtol=1e-5, atol=1e-4)

    from tests.test_quantized import _llama
    from xinfer import Engine, EngineConfig
    _llama(hidden=256, inter=512, layers=2, vocab=256).to(torch.bfloat16).save_pretrained(tmp_path / "m")
    from safetensors.torch import load_file
    table = load_file(tmp_path / "m" / "model.safetensors")["model.embed_tokens.weight"]
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, 256, 48)]
    lps = {}
    for matmul in ("float32", "bfloat16"):
        e = Engine(EngineConfig(model=str(tmp_path / "m"), cpu_matmul=matmul, num_kv_blocks=32, block_size=4),
                   log_level="warning")
        try:
            m = e.runner.model
            lins = [x for x in m.modules() if type(x).__name__ == "Linear" and x is not m.lm_head]
            lps[matmul] = e.runner.log_probs(prompt, chunk=5)
            if matmul == "bfloat16":
                assert all(isinstance(x.blocks, qgemm.Bf16Weight) and x.weight.numel() == 0 and x.fast is None
                           for x in lins)
                assert isinstance(m.head_blocks, qgemm.Bf16Weight) and m.head_fast is None
                # packed from the file as read (layers.hold_packed): nothing widened to float32, the
                # table looked up in its panels exactly
                assert {"model.embed_tokens.weight", "model.layers.1.self_attn.qkv_proj.weight"} <= m.held
                ids = torch.tensor([[0, 17, 255], [3, 3, 128]])
                assert torch.equal(m.model.embed_tokens(ids), table[ids].float())
                _c_step_matches(e, [prompt[:7], prompt[5:30]], 10)
        finally:
            e.close()
    _within_budget(lps["float32"], lps["bfloat16"])

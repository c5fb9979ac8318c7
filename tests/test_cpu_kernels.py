"""The C kernels of the CPU path (ops/cpu_kernels.c) against torch references: GGUF block matmuls
against float32 matmuls on gguf-py's own dequantization, paged decode attention against the torch
backend's gather + SDPA, the fused RMSNorm and rotary against their torch formulas, the one-call
decode step against the op-by-op path. The AVX2 build runs the same tests in a subprocess."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from ops import cpu_isa, cpu_kernels
from ops.attention import AttnMetadata, TorchBackend
from ops.linear import linear
from ops.norm import RMSNorm
from ops.quant import QuantWeight
from ops.block_types import BLOCK_TYPES
from ops.rotary import RotaryEmbedding, _apply

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels are off here (no C compiler, neither AVX-512 nor AVX2, or XINFER_CPU_KERNELS=0); "
                                "the torch paths they replace run instead")

TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q2_K"]
# where a K-quant super-block keeps its float16 d (and dmin): gguf has no quantizer for these
_K_HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82)}
# float32 sums of 160-256 products in another order than the reference's (a draw once landed
# 1.4e-5 off on a value of 0.33)
SUM = dict(rtol=1e-5, atol=5e-5)
# int16 against its float32 reference, itself rounded twice (x_q (w - m)^T + x m^T) where the kernels
# scale exact int32 block sums: outputs of ~15 came 1.4e-5 apart (relative)
I16_SUM = dict(rtol=5e-5, atol=1e-4)


def _blocks(type_name, n=96, k=160, seed=0):
    if type_name in _K_HALVES:  # random super-blocks with sane scales
        qtype = GGMLQuantizationType[type_name]
        raw = np.random.default_rng(seed).integers(0, 256, size=(n, 1, BLOCK_TYPES[type_name][1]), dtype=np.uint8)
        for at in _K_HALVES[type_name]:
            raw[..., at:at + 2] = np.array([5e-4], np.float16).view(np.uint8)  # weights of ~0.05 as below
        raw = raw.reshape(n, -1)
        ref = torch.from_numpy(dequantize(raw, qtype).reshape(n, 256).astype(np.float32))
        return QuantWeight.from_gguf(type_name, raw, (n, 256)), ref
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).numpy()
    w[3, :32] *= 40  # an outlier block: per-block scales keep the other blocks fine
    qtype = GGMLQuantizationType[type_name]
    raw = quantize(w, qtype)
    ref = torch.from_numpy(dequantize(raw, qtype).reshape(n, k).astype(np.float32))
    return QuantWeight.from_gguf(type_name, raw.reshape(n, -1), (n, k)), ref


@pytest.mark.parametrize("type_name", TYPES)
def test_blocks_dequantize_exactly_like_gguf(type_name):
    q, ref = _blocks(type_name)
    assert torch.equal(q.dequantize(), ref)


@pytest.mark.parametrize("type_name", TYPES)
def test_block_matmul_matches_float32(type_name):
    q, ref = _blocks(type_name)
    bias = torch.randn(ref.shape[0])
    for rows in [1, 2, 3, 4, 5, q.max_rows, q.max_rows + 1, 33]:
        x = torch.randn(rows, ref.shape[1])
        want = x @ ref.T + bias
        got = linear(x, ref, bias, q)  # max_rows + 1 and more: oneDNN on the float weight
        torch.testing.assert_close(got, want, **SUM)
        torch.testing.assert_close(q(x), x @ ref.T, **SUM)  # the kernel at every size


@pytest.mark.skipif(not cpu_kernels.has_bf16(), reason="this build has no AVX512_BF16 dot products (the bf16 "
                    "build test reruns this where the CPU has them)")
@pytest.mark.parametrize("type_name", TYPES)
def test_bf16_dot_products_match_rounded_float32(type_name):
    """--cpu-matmul bfloat16: weights and activations rounded to bfloat16, float32 sums; q4 weights
    in panels are not rounded (exact integers, panel_dot_q4x). A row's result does not depend on the
    rows beside it (what keeps speculative decoding lossless here)."""
    q, ref = _blocks(type_name)
    q.use("bfloat16")
    assert (q.panels is not None) == (q.gs == 1 and q.shape[0] % 16 == 0)  # what the panel kernel takes
    exact = q.kind == "q4" and q.panels is not None
    for rows in [1, 2, 3, 5, 8, 9, 12, 16, 17, 24, 40, 64]:  # past 16: several passes
        x = torch.randn(rows, ref.shape[1])
        got = q(x)
        torch.testing.assert_close(got, x.bfloat16().float() @ (ref if exact else ref.bfloat16().float()).T, **SUM)
        assert torch.equal(q(x[-1:]), got[-1:])


@pytest.mark.parametrize("type_name", TYPES)
def test_float32_panels_match_float32(type_name):
    """--cpu-matmul float32 (and int16 past 3 rows) on the AVX2 build: the weights also in 8-column
    panels, each rebuilt once a pass for up to 12 rows; a row's sums do not depend on its neighbours."""
    q, ref = _blocks(type_name)
    q.use("float32")
    panels = cpu_kernels.simd_width() == 256 and q.gs == 1 and q.shape[0] % 8 == 0
    assert (q.panels is not None) == panels
    for rows in [1, 2, 5, 12, 13, 25, 64]:
        x = torch.randn(rows, ref.shape[1])
        got = q(x)
        torch.testing.assert_close(got, x @ ref.T, **SUM)
        assert torch.equal(q(x[-1:]), got[-1:])


def _int16_reference(q, ref, x):
    """x quantized per 32 values to 16 bits against the weights' d * q, plus the offsets m against
    the exact sums of x."""
    n, k = q.shape
    m = torch.zeros(n, k) if q.m is None else q.m.repeat_interleave(32 // q.gs, 1)
    xb = x.view(len(x), k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    xq = torch.round(xb * torch.where(amax > 0, 32767 / amax, 0)) * (amax / 32767)
    return xq.view(len(x), k) @ (ref - m).T + x @ m.T


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("n", [96, 40])
def test_int16_activations_match_their_reference(type_name, n):
    """--cpu-matmul int16: each block's integer products summed exactly, scaled once; within 2e-4 of
    float32 (relative, over the output: a draw with _blocks' outlier block came 1.04e-4 off). Up to 3 rows the blocks' own integers; past that, in the AVX2
    build, the integers widened in 8-column panels (16 columns a pass, and 8 where n leaves them: n = 40),
    any number of rows (linear() sends up to max_rows), where a row's result does not depend on its neighbours."""
    q, ref = _blocks(type_name, n=n)
    q.use("int16")
    assert (q.wide is not None) == (cpu_kernels.simd_width() == 256 and q.gs == 1 and n % 8 == 0)
    bias = torch.randn(n)
    for rows in [1, 2, 3, 4, 5, 9, 16, 33, 70]:
        x = torch.randn(rows, ref.shape[1])
        x[0, :32] = 0  # an all-zero block: scale 0, no division by it
        got, want = q(x), x @ ref.T
        # past 3 rows, weights without panels (two scales a block) run the float32 row kernels
        torch.testing.assert_close(got, _int16_reference(q, ref, x) if rows <= 3 or q.wide is not None else want,
                                   **I16_SUM)
        assert (got - want).norm() <= 2e-4 * want.norm()
        if rows > 3:
            assert torch.equal(q(x[-4:]), got[-4:])
        if q.wide is not None and rows <= q.max_rows:  # what linear() sends to the blocks
            got = linear(x, torch.empty(0), bias, q)
            torch.testing.assert_close(got, _int16_reference(q, ref, x) + bias, **I16_SUM)


def test_fused_blocks_keep_row_order():
    parts = [_blocks(t, n=n, seed=i) for i, (t, n) in enumerate([("Q4_1", 64), ("Q4_0", 32), ("Q4_1", 32)])]
    fused = QuantWeight.cat([p for p, _ in parts])
    assert torch.equal(fused.dequantize(), torch.cat([r for _, r in parts]))
    # mixed kinds (Q4_K_M's Q6_K rows beside Q4_K ones) are all read as q8, the same weights
    mixed = [_blocks(t, n=32, k=256, seed=i) for i, t in enumerate(["Q4_K", "Q6_K", "Q8_0", "Q5_1"])]
    fused = QuantWeight.cat([p for p, _ in mixed])
    assert (fused.kind, fused.gs, fused.m is not None) == ("q8", 2, True)
    ref = torch.cat([r for _, r in mixed])
    assert torch.equal(fused.dequantize(), ref)
    x = torch.randn(3, 256)
    torch.testing.assert_close(fused(x), x @ ref.T, **SUM)


def _paged_case(seed, lens, query_lens, hq=6, hkv=2, d=64, bs=4):
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-n // bs) for n in lens) + 3
    kc, vc = torch.randn(nb, bs, hkv, d, generator=g), torch.randn(nb, bs, hkv, d, generator=g)
    perm = torch.randperm(nb, generator=g).tolist()  # blocks scattered through the cache
    width = max(-(-n // bs) for n in lens)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, n in enumerate(lens):
        for j in range(-(-n // bs)):
            table[i, j] = perm.pop()
    starts = np.cumsum([0] + query_lens)
    meta = AttnMetadata(cu_seqlens_q=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
                        block_tables=table, slot_mapping=torch.zeros(0, dtype=torch.long), query_lens=query_lens,
                        kv_lens=lens, block_size=bs)
    q = torch.randn(int(starts[-1]), hq, d, generator=g)
    return q, kc, vc, meta


def _plain_meta(meta):
    return AttnMetadata(**{f: getattr(meta, f) for f in (
        "cu_seqlens_q", "seq_lens", "block_tables", "slot_mapping", "query_lens", "kv_lens", "block_size")})


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 30.0)])
def test_paged_decode_matches_gather_sdpa(window, softcap):
    fused, plain = TorchBackend(), TorchBackend()
    plain._c = None
    # decodes only, and decodes mixed with a prefill chunk (which takes the SDPA path in both); one or
    # two long sequences: each (sequence, KV head) split into position ranges, merged after (some
    # empty under the window); several sequences of several spans, each fetching the next one's rows
    for lens, qlens in [([1, 7, 16, 33], [1, 1, 1, 1]), ([9, 20, 3], [1, 6, 1]), ([300], [1]), ([70], [1]),
                        ([150, 260, 140, 200], [1, 1, 1, 1])]:
        q, kc, vc, meta = _paged_case(len(lens), lens, qlens)
        q = torch.cat([q, torch.randn(q.shape[0], 2, q.shape[2])], 1)[:, :q.shape[1]]  # a view into a QKV output
        want = plain.forward(q, kc, vc, _plain_meta(meta), 0.125, window, softcap)
        got = fused.forward(q, kc, vc, meta, 0.125, window, softcap)
        assert meta.cache["torch"]["decode_c"] is not None
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_kernels.has_bf16(), reason="this build has no AVX512_BF16 dot products (the bf16 "
                    "build's run of this file tests them where the CPU has them)")
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 30.0)])
@pytest.mark.parametrize("hq,hkv,d", [(6, 2, 64), (8, 2, 128), (3, 3, 64), (10, 2, 64)])
def test_paged_decode_bf16_dot_products(window, softcap, hq, hkv, d):
    """A bfloat16 cache's decode attention on the dot-product units (q and p split in hi + lo parts)
    keeps float32's precision against the torch path reading the same cache: query groups of 1 to 5,
    head sizes 64 and 128, chunks off the vector width, long sequences split in ranges."""
    fused, plain = TorchBackend(), TorchBackend()
    plain._c = None
    for lens in ([1, 7, 16, 33], [300], [70, 129], [150, 260, 140, 200]):
        q, kc, vc, meta = _paged_case(len(lens), lens, [1] * len(lens), hq=hq, hkv=hkv, d=d)
        q = torch.cat([q, torch.randn(q.shape[0], 2, d)], 1)[:, :hq]  # a view into a QKV output
        kc, vc = kc.bfloat16(), vc.bfloat16()
        want = plain.forward(q, kc, vc, _plain_meta(meta), 0.125, window, softcap)
        got = fused.forward(q, kc, vc, meta, 0.125, window, softcap)
        assert meta.cache["torch"]["decode_c"] is not None
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _prefill_cases(hq, hkv, d):
    """Whole prompts, chunks after earlier context, lengths off the vector width and past a span (128
    keys), beside decode rows; q a view into a QKV output, as in a model."""
    for lens, qlens in [([37], [37]), ([300, 5, 21], [300, 1, 21]), ([150, 80], [129, 17]),
                        ([1, 40, 33, 19], [1, 40, 30, 19])]:
        q, kc, vc, meta = _paged_case(len(lens), lens, qlens, hq=hq, hkv=hkv, d=d)
        yield torch.cat([q, torch.randn(q.shape[0], 2, d)], 1)[:, :hq], kc, vc, meta


@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (None, 30.0), (40, None)])
@pytest.mark.parametrize("hq,hkv,d", [(6, 2, 64), (4, 4, 128), (3, 1, 64)])
def test_paged_prefill_matches_gather_sdpa(window, softcap, hq, hkv, d):
    """Prefill chunks read the paged cache in place (xinfer_paged_prefill), float32 cache (_prefill_cases)."""
    fused, plain = TorchBackend(), TorchBackend()
    plain._c = None
    for q, kc, vc, meta in _prefill_cases(hq, hkv, d):
        want = plain.forward(q, kc, vc, _plain_meta(meta), 0.125, window, softcap)
        got = fused.forward(q, kc, vc, meta, 0.125, window, softcap)
        assert meta.cache["torch"]["prefill_c"] is not None
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_kernels.has_bf16(), reason="this build has no AVX512_BF16 dot products (the bf16 "
                    "build's run of this file tests them where the CPU has them)")
@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (None, 30.0)])
@pytest.mark.parametrize("hq,hkv,d", [(6, 2, 64), (8, 2, 128), (3, 3, 64), (10, 2, 64)])
def test_paged_prefill_bf16_dot_products(window, softcap, hq, hkv, d):
    """A bfloat16 cache's prefill attention on the dot-product units rounds the scaled queries and the
    probabilities to bfloat16 once: against the torch path given the same rounded queries, what is left
    is the probabilities' rounding, at most 2^-9 of the largest value a row averages (bound with margin)."""
    fused, plain = TorchBackend(), TorchBackend()
    plain._c = None
    for q, kc, vc, meta in _prefill_cases(hq, hkv, d):
        kc, vc = kc.bfloat16(), vc.bfloat16()
        want = plain.forward(q.bfloat16().float(), kc, vc, _plain_meta(meta), 0.125, window, softcap)
        got = fused.forward(q, kc, vc, meta, 0.125, window, softcap)
        assert meta.cache["torch"]["prefill_c"] is not None
        bound = 2 ** -8 * vc.float().abs().max().item() + 1e-5
        assert (got - want).abs().max().item() <= bound
        assert (got - want).abs().max().item() > 0  # the rounded path ran, not the float32 one


def test_silu_mul_in_one_pass():
    """silu(gate) * up over a gate/up output: float32 as torch computes it, bfloat16 rounded once from
    the float32 result (torch rounds silu's output and then the product)."""
    gu = torch.randn(37, 2 * 96, generator=torch.Generator().manual_seed(0)) * 4
    gate, up = gu.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(cpu_kernels.silu_mul(gu), want, rtol=1e-6, atol=1e-6)
    gb = gu.bfloat16()
    got = cpu_kernels.silu_mul(gb)
    gate, up = gb.float().chunk(2, dim=-1)
    exact = torch.nn.functional.silu(gate) * up
    assert got.dtype == torch.bfloat16 and got.shape == (37, 96)
    assert ((got.float() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-30).all()  # within one rounding
    assert cpu_kernels.silu_mul(gu[:, :100].contiguous()) is None  # halves not whole vectors: the torch path


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_fused_rmsnorm_with_residual(offset):
    norm = RMSNorm(48, 1e-6, offset)
    norm.weight.data = torch.randn(48)
    x, res = torch.randn(5, 48), torch.randn(5, 48)
    xf = x + res
    want = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (norm.weight + offset)
    out, new_res = norm.add_forward(x, res.clone())
    torch.testing.assert_close(new_res, xf, rtol=0, atol=0)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    out0, same = norm.add_forward(x, None)
    assert same is x
    torch.testing.assert_close(out0, norm(x.clone()), rtol=0, atol=0)


@pytest.mark.parametrize("T", [7, 150])  # 150: a prompt's rows, split among the threads
def test_rope_in_place_matches_torch(T):
    rope = RotaryEmbedding(64, 128, 10000.0)
    qkv = torch.randn(T, (4 + 2 + 2) * 64)
    q, k, _ = qkv.split([4 * 64, 2 * 64, 2 * 64], -1)
    q, k = q.view(T, 4, 64), k.view(T, 2, 64)
    pos = torch.tensor([0, 1, 2, 50, 51, 90, 127]) if T == 7 else torch.randint(0, 128, (T,))
    cos, sin = rope.cos[pos].unsqueeze(1), rope.sin[pos].unsqueeze(1)
    want_q, want_k = _apply(q.clone(), cos, sin, 64), _apply(k.clone(), cos, sin, 64)
    got_q, got_k = rope(pos, q, k)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-6)


def test_engine_without_kernels_gives_the_same_tokens(tiny_llama_path, monkeypatch):
    """The torch paths that run where the kernels don't build (XINFER_CPU_KERNELS=0) agree."""
    import ops.norm
    import ops.rotary
    from xinfer import Engine, EngineConfig, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[3, 5, 7, 9, 11, 13, 17, 19, 23], [11, 13], list(range(40, 70))]

    def run():
        return [o.token_ids for o in Engine(EngineConfig(model=tiny_llama_path, kv_cache_gb=0.01),
                                            log_level="warning").generate(prompts, params)]

    with_kernels = run()
    for mod in (ops.norm, ops.rotary, cpu_kernels):
        monkeypatch.setattr(mod, "lib", lambda: None)
    assert run() == with_kernels


@pytest.mark.parametrize("arch", ["llama", "llama_tied_llama3_rope", "qwen2", "qwen3", "mistral", "gemma3"])
def test_one_call_decode_step_matches_the_op_by_op_path(arch, tmp_path):
    """The C decode step (ops/cpu_decode.py) against the per-op path on the same GGUF blocks, for each
    family's quirks: QKV bias (qwen2), q/k norms (qwen3), a sliding window (mistral), llama3 rope,
    Gemma 3's four norms a layer, GELU, (1 + w) scales and interleaved sliding layers. The per-op path
    is the one tests/test_models.py checks against transformers."""
    from tests.test_models import ARCHS, PROMPTS
    from xinfer import Engine, EngineConfig, SamplingParams
    from xinfer.models.layers import Linear

    torch.manual_seed(0)
    ref = ARCHS[arch]()
    with torch.no_grad():
        for p in ref.parameters():  # biases and norms start at 0 and 1: make each of them matter
            p.add_(torch.randn_like(p) * 0.05)
    ref.save_pretrained(tmp_path)

    def run(fused):
        engine = Engine(EngineConfig(model=str(tmp_path), block_size=4, num_kv_blocks=200, prefill_chunk_size=8,
                                     max_num_batched_tokens=24, max_num_seqs=8), log_level="warning")
        model = engine.runner.model
        for i, lin in enumerate(m for m in model.modules() if isinstance(m, Linear)):
            kind = ("Q8_0", "Q4_1", "Q4_0")[i % 3]
            w = lin.weight.detach().numpy()
            lin.blocks = QuantWeight.from_gguf(kind, quantize(w, GGMLQuantizationType[kind]).reshape(w.shape[0], -1),
                                               w.shape)
            lin.weight.data.copy_(lin.blocks.dequantize())  # prefill reads the same weights
        if not fused:
            model._cpu_decoder = False
        rows, orig = [], model.compute_logits
        model.compute_logits = lambda h: rows.append(orig(h)) or rows[-1]
        outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        return [o.token_ids for o in outs], rows, model._cpu_decoder

    tokens, rows, decoder = run(fused=True)
    want_tokens, want_rows, _ = run(fused=False)
    assert decoder not in (None, False)
    assert tokens == want_tokens
    assert len(rows) == len(want_rows)
    worst = max((a - b).abs().max().item() for a, b in zip(rows, want_rows))
    assert worst < 1e-4, f"{arch}: max |logit diff| {worst:.2e}"


@pytest.mark.skipif(not cpu_kernels.has_bf16(), reason="this build has no AVX512_BF16 dot products (the bf16 "
                    "build test reruns this where the CPU has them)")
def test_one_call_decode_step_bf16_up_to_64_rows():
    """With bfloat16 panels the blocks take batches of up to 64 rows (ops/cpu_isa.block_rows), and so
    does the one-call C step: against the per-op path on the same blocks, for one pass of 16 rows, two,
    and four."""
    from xinfer import Engine, EngineConfig
    from xinfer.workers.batch import forward
    e = Engine(EngineConfig(kv_cache_gb=0.15, cpu_matmul="bfloat16"), log_level="warning")
    try:
        r, model = e.runner, e.runner.model
        assert model.head_blocks.max_rows >= 64 and model.cpu_decoder().max_rows == 64  # a Q8_0 head: every batch (ops/qgemm.py)
        for n in (5, 24, 64):
            rows = [(list(range(3 * i, 3 * i + 3)), 40, [100 + i]) for i in range(n)]  # 192 blocks of 218
            outs = []
            for fused in (True, False):
                model._cpu_decoder = None if fused else False
                with torch.inference_mode():
                    outs.append(model.compute_logits(forward(model, r.backend, r.device, r.block_size, rows)))
            assert (outs[0] - outs[1]).abs().max() < 1e-3, n
    finally:
        e.close()


def test_c_sampler_draws_the_inverse_cdf_token():
    """cpu_kernels.sample (what ops/sampling.py sample uses without top-k / top-p / min-p): the token
    draw() picks from the softmax at each row's temperature with the same U(0, 1), for vocabularies
    with and without a vector tail; banned (-inf) tokens never, even at the ends of U(0, 1)."""
    from ops.sampling import draw
    g = torch.Generator().manual_seed(3)
    for V in (49152, 1000, 12):
        logits = torch.randn(300, V, generator=g) * 3
        logits[::7, ::3] = -float("inf")
        temp = torch.rand(300, generator=g) * 1.5 + 0.05
        u = torch.rand(300, 1, generator=g)
        u[:3, 0] = torch.tensor([0.0, 1 - 2 ** -24, 0.5])
        got = cpu_kernels.sample(logits, temp, u)
        probs = torch.softmax(logits / temp[:, None], dim=-1)
        assert (got == draw(probs, u)).float().mean() >= 0.99, V
        hi = probs.cumsum(-1).gather(1, got[:, None])  # where else: U on the boundary, the sums' order
        assert ((hi - probs.gather(1, got[:, None]) <= u + 1e-4) & (u <= hi + 1e-4)).all(), V
        assert (probs.gather(1, got[:, None]) > 1e-30).all()  # the ends of U(0, 1): tokens of weight
        strided = torch.cat([logits, logits], 1)[:, :V]  # rows further apart than V
        assert torch.equal(cpu_kernels.sample(strided, temp, u), got)


def test_the_build_is_the_one_asked_for():
    want = 256 if os.environ.get("XINFER_CPU_ISA") == "avx2" else None
    width = cpu_kernels.lib().xinfer_simd_width()
    assert width in (256, 512) and (want is None or width == want)


@pytest.mark.skipif(cpu_kernels.has_bf16() or "avx512_bf16" not in cpu_isa.cpu_flags(),
                    reason="this build has the bf16 kernels already, or the CPU lacks AVX512_BF16")
def test_the_bf16_build_passes_its_tests(tmp_path):
    """The suite builds the kernels below BF16 (conftest: exact float32); where the CPU has
    AVX512_BF16, XINFER_CPU_ISA=avx512_bf16 builds its dot products and reruns what tests them."""
    env = dict(os.environ, XINFER_CPU_ISA="avx512_bf16", XINFER_CACHE_DIR=str(tmp_path))
    tests = os.path.dirname(__file__)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "bf16 and not bf16_build", __file__,
                        os.path.join(tests, "test_spec.py"), os.path.join(tests, "test_qgemm.py")], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-1000:]


@pytest.mark.skipif(os.environ.get("XINFER_CPU_ISA") == "avx2", reason="this is the AVX2 rerun itself")
def test_the_avx2_build_passes_the_same_tests(tmp_path):
    """AVX2 machines (no AVX-512) get their own matmul and attention kernels: XINFER_CPU_ISA=avx2 builds
    them for Haswell, which this CPU also runs, with every test above and the KV formats' C tests."""
    if cpu_isa.level_of(cpu_isa.cpu_flags()) == "none":
        pytest.skip("this CPU has no AVX2")
    env = dict(os.environ, XINFER_CPU_ISA="avx2", XINFER_CACHE_DIR=str(tmp_path))
    kv = str(Path(__file__).parent / "test_kv_quant.py")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not avx2_build and not bf16",
                        __file__, kv + "::test_torch_and_c_attention_on_quantized_caches",
                        kv + "::test_c_writes_turbo_rows_as_torch_does", kv + "::test_c_writes_the_bytes_torch_writes"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-1000:]

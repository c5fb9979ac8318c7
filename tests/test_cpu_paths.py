"""The CPU paths (issue 12): the vector-unit level and XINFER_CPU_ISA, the default each level
gets, and the bfloat16 path's next-token distributions against the float32 path's on the bundled
model, by llama.cpp's measures (mean KL divergence, same top token, perplexity). The bfloat16
path runs on any CPU (slowly without BF16 units), so its numerics are checked everywhere; its
speed is only claimed where the CPU has the units."""
import importlib

import pytest
import torch

from bench.cmd_fidelity import TEXT, compare
from ops import cpu_isa
from xinfer import Engine, EngineConfig, SamplingParams

AVX512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}


@pytest.fixture
def isa(monkeypatch):
    """Set XINFER_CPU_ISA (None: unset) and re-read the level."""
    def use(value):
        if value is None:
            monkeypatch.delenv("XINFER_CPU_ISA", raising=False)
        else:
            monkeypatch.setenv("XINFER_CPU_ISA", value)
        cpu_isa.level.cache_clear()
        return cpu_isa.level()
    yield use
    cpu_isa.level.cache_clear()


def test_levels_from_flags():
    assert cpu_isa.level_of(set()) == "none"
    assert cpu_isa.level_of({"avx2", "fma"}) == "avx2"
    assert cpu_isa.level_of(AVX512) == "avx512"
    assert cpu_isa.level_of(AVX512 | {"avx512_vnni"}) == "avx512_vnni"
    assert cpu_isa.level_of(AVX512 | {"avx512_bf16"}) == "avx512"  # BF16 without VNNI: not the next level
    assert cpu_isa.level_of(AVX512 | {"avx512_vnni", "avx512_bf16"}) == "avx512_bf16"
    assert cpu_isa.level_of(AVX512 | {"avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"}) == "amx"


def test_xinfer_cpu_isa_forces_a_lower_level_only(isa):
    found = isa(None)
    assert found == cpu_isa.level_of(cpu_isa.cpu_flags()) or found == "none"
    if found != "none":
        assert isa("avx2") == "avx2" and not cpu_isa.has_bf16()
    assert isa("amx") == found  # more than the CPU has: what it has (logged)
    with pytest.raises(ValueError, match="XINFER_CPU_ISA"):
        isa("sse9")


def test_defaults_are_the_fast_path_for_the_cpu_found(isa, monkeypatch):
    def resolved(**kw):
        return EngineConfig(device="cpu", **kw).resolve({}).cpu_matmul
    monkeypatch.setenv("XINFER_CPU_MATMUL", "bfloat16")
    assert resolved() == "bfloat16" and resolved(dtype="float32") == "float32"
    monkeypatch.setenv("XINFER_CPU_MATMUL", "int8")
    with pytest.raises(ValueError, match="XINFER_CPU_MATMUL"):
        resolved()
    monkeypatch.delenv("XINFER_CPU_MATMUL")
    isa(None)
    assert resolved() == ("bfloat16" if cpu_isa.has_bf16() else "int16" if cpu_isa.level() == "avx2" else "float32")
    assert resolved(dtype="float32") == "float32"  # asked for float32: exact
    assert resolved(cpu_matmul="bfloat16") == "bfloat16"
    # the bfloat16 path keeps its KV cache in bfloat16 too, unless a cache format or a path was asked for
    kv = lambda **kw: EngineConfig(device="cpu", **kw).resolve({}).kvcache_dtype
    assert kv() == ("bf16" if cpu_isa.has_bf16() else "auto")
    assert kv(dtype="float32") == kv(cpu_matmul="bfloat16") == "auto" and kv(kvcache_dtype="fp8") == "fp8"
    if cpu_isa.level() != "none":
        isa("avx512" if cpu_isa.LEVELS.index(cpu_isa.level()) >= 2 else "avx2")
        # no BF16 units: float32 GEMMs; AVX2 alone: 16-bit integer activations in the block kernels
        assert resolved() == ("int16" if cpu_isa.level() == "avx2" else "float32")
    with pytest.raises(ValueError, match="cpu-matmul"):
        EngineConfig(cpu_matmul="int4")


@pytest.fixture(scope="module")
def text_ids():
    from xinfer.loader import load_model_info
    return load_model_info(None).tokenizer.encode(TEXT.read_text())[:640]


def _log_probs(ids, **kw):
    e = Engine(EngineConfig(kv_cache_gb=0.1, prefill_chunk_size=256, **kw), log_level="warning")
    try:
        return e.runner.log_probs(ids, 256), e
    finally:
        e.close()


def test_log_probs_are_the_engines_prompt_logprobs(text_ids):
    """The fidelity tool's teacher-forced scores are the ones a request gets (float32, exact path)."""
    lp, _ = _log_probs(text_ids[:300], dtype="float32", cpu_matmul="float32")
    e = Engine(EngineConfig(kv_cache_gb=0.1, dtype="float32", cpu_matmul="float32"), log_level="warning")
    out = e.generate([text_ids[:300]], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    e.close()
    got = torch.tensor([p[0] for p in out.prompt_logprobs[1:]])
    want = lp[:-1].gather(1, torch.tensor(text_ids[1:300])[:, None])[:, 0]
    assert torch.allclose(got, want, atol=1e-4)


def test_bfloat16_path_within_the_budget(text_ids):
    """The default path on a BF16 CPU (GGUF blocks for small batches, bfloat16 GEMMs for the rest, a
    bfloat16 KV cache):
    mean KLD <= 0.002, same top token >= 98% (97% over this shorter text), perplexity within 1%."""
    ref, _ = _log_probs(text_ids, dtype="float32", quantization="none", cpu_matmul="float32")
    fast, e = _log_probs(text_ids, cpu_matmul="bfloat16", kvcache_dtype="bf16")  # the default's cache too
    assert e.config.cpu_matmul == "bfloat16"
    r = compare(ref, fast, text_ids)
    assert r["mean_kld"] <= 0.002, r
    assert r["same_top"] >= 0.97, r
    assert abs(r["ppl_ratio"] - 1) <= 0.01, r
    same, _ = _log_probs(text_ids, dtype="float32", cpu_matmul="float32")  # blocks alone: exact weights
    assert compare(ref, same, text_ids)["mean_kld"] < 1e-6


def test_int16_path_within_the_budget(text_ids):
    """The default path on an AVX2 CPU: 16-bit activations in the block kernels, up to 3 rows against the
    blocks' own integers (the text scored 3 tokens a step), past that (AVX2) against the widened panels
    (50 a step, up to the blocks' max_rows); same budget as above, which it meets by far (bench/NOTES-cpu.md: mean KLD 0.00000
    over 2,047 tokens)."""
    ids = text_ids[:300]
    ref, _ = _log_probs(ids, dtype="float32", quantization="none", cpu_matmul="float32")
    e = Engine(EngineConfig(kv_cache_gb=0.1, cpu_matmul="int16"), log_level="warning")
    try:
        for step in (3, 50):
            r = compare(ref, e.runner.log_probs(ids, step), ids)
            assert r["mean_kld"] <= 0.002 and r["same_top"] >= 0.97 and abs(r["ppl_ratio"] - 1) <= 0.01, (step, r)
    finally:
        e.close()


def test_bfloat16_greedy_decode_matches_small_batches():
    """Decode batches up to XINFER_QUANT_MAX_ROWS rows read the GGUF blocks on either setting, so a
    lone greedy request's tokens after a short prompt are the same."""
    from xinfer.models.layers import Linear
    prompt = "The capital of France is"
    outs = []
    for cm in ("float32", "bfloat16"):
        e = Engine(EngineConfig(kv_cache_gb=0.1, cpu_matmul=cm), log_level="warning")
        # the big batches' weights are packed once (layers.attach_fast), the plain ones freed
        model = e.runner.model
        lins = [m for m in model.modules() if isinstance(m, Linear)]
        assert lins and all(m.blocks is not None and m.weight.numel() == 0 for m in lins)
        assert {m.fast.dtype for m in lins} == {getattr(torch, cm)}
        # the Q8_0 head (and table) held once as blocks on the fast path (ops/qgemm.py): no packed copy
        assert model.head_fast is None and (type(model.head_blocks).__name__ == "PackedWeight") == (cm == "bfloat16")
        outs.append(e.generate([e.tokenizer.encode(prompt)], SamplingParams(max_tokens=12, temperature=0))[0].token_ids)
        e.close()
    assert outs[0] == outs[1]


def test_bench_fidelity_command(tmp_path, capsys):
    cli = importlib.import_module("bench.cli")
    out = tmp_path / "f.json"
    assert cli.main(["fidelity", "--tokens", "200", "--b", "cpu_matmul=bfloat16", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mean KLD" in printed and "same top token" in printed and "perplexity" in printed
    import json
    r = json.loads(out.read_text())
    assert r["positions"] == 199 and r["b"]["cpu_matmul"] == "bfloat16" and r["cpu"] in cpu_isa.LEVELS


def test_bf16_mlp_chain_matches_the_float32_round_trip():
    """With bfloat16 GEMMs, gate and up stay bfloat16 through the activation into the down
    projection (which rounds its input to bfloat16 anyway): the output is float32 and equals the
    float32 round trip within bfloat16 rounding; rows the blocks would take still go to them."""
    import torch.nn.functional as F

    from xinfer.models.layers import GatedMLP
    torch.manual_seed(0)
    mlp = GatedMLP(64, 128)
    for lin in (mlp.gate_up_proj, mlp.down_proj):
        lin.weight.data.copy_(torch.randn_like(lin.weight) * 0.1)
        lin.fast = lin.weight.data.to(torch.bfloat16)
    x = torch.randn(40, 64)
    gate, up = F.linear(x.to(torch.bfloat16), mlp.gate_up_proj.fast).float().chunk(2, dim=-1)
    want = F.linear((F.silu(gate) * up).to(torch.bfloat16), mlp.down_proj.fast).float()
    got = mlp(x)
    assert got.dtype == torch.float32
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    seen = []

    class Spy:  # GGUF blocks that take up to 16 rows
        max_rows = 16

        def __call__(self, t):
            seen.append(t.dtype)
            return F.linear(t, mlp.down_proj.weight)
    mlp.down_proj.blocks = Spy()
    mlp(x[:4])  # a few rows: the down projection's blocks take them, in float32
    assert seen == [torch.float32]


def test_bf16_between_norms_and_gemms_changes_no_number():
    """With bfloat16 GEMMs, the plain decoder layer passes bfloat16 between its norms and GEMMs (the
    norm reads the GEMM's output and writes the next GEMM's input): bit for bit what float32 with a
    cast around each GEMM gives, for a batch the bfloat16 weights take and one the blocks take."""
    from xinfer.workers.batch import forward
    e = Engine(EngineConfig(kv_cache_gb=0.05, cpu_matmul="bfloat16"), log_level="warning")
    try:
        r = e.runner
        layers = r.model.model.layers
        assert all(ly.bf16_io for ly in layers)
        for n in (80, 3):  # past the blocks' max_rows (bfloat16 weights), and a few rows (the GGUF blocks)
            rows = [(list(range(6)), 0, list(range(100, 100 + n)))]
            outs = []
            for io in (True, False):
                for ly in layers:
                    ly.bf16_io = io
                with torch.inference_mode():
                    outs.append(r.model.compute_logits(forward(r.model, r.backend, r.device, r.block_size, rows)))
            assert torch.equal(outs[0], outs[1]), n
    finally:
        e.close()


def test_packed_bf16_weight_gives_the_plain_bf16_product():
    """The bfloat16 copy is packed once into oneDNN's layout (where oneDNN is on): the product is
    the plain bfloat16 GEMM's, for 2-D and 3-D activations and an empty batch."""
    import torch.nn.functional as F

    from ops import linear as lin
    torch.manual_seed(0)
    w, b = torch.randn(96, 64), torch.randn(96)
    packed = lin.pack(w, torch.bfloat16)
    # oneDNN lays bfloat16 out only where the CPU has AVX-512 (or AVX-NE-CONVERT): elsewhere it stays plain
    onednn_bf16 = lin._ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert packed.is_mkldnn == onednn_bf16 and packed.shape == w.shape and packed.dtype == torch.bfloat16
    assert lin.nbytes(packed) == w.numel() * 2
    for x in (torch.randn(40, 64), torch.randn(5, 8, 64)):
        want = F.linear(x.to(torch.bfloat16), w.to(torch.bfloat16)).float() + b
        assert torch.equal(lin.linear(x, w, b, fast=packed), want)
    assert lin.linear(torch.randn(0, 64), w, fast=packed).shape == (0, 96)


_PRIMITIVES = """
import os, torch
from ops.linear import linear, pack
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) / 1024
dt = torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
w, x = pack(torch.randn(1536, 576), dt), torch.randn(1100, 576)
linear(x[:64], None, fast=w)
r0 = rss()
for m in range(64, 1064, 4):  # a prefill step's row count each: one oneDNN primitive each
    linear(x[:m], None, fast=w)
print(os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"], os.environ["LRU_CACHE_CAPACITY"], rss() - r0)
"""


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_onednn_primitive_caches_are_bounded():
    """oneDNN and ideep keep a primitive per row count, 1,024 of each by default: a server whose
    prefill steps each bring a new count grew its heap by hundreds of MB. ops.linear caps both
    (a setting of the user's is kept)."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    runs = {}
    for cap in (None, "1024"):
        e = dict(env, **({} if cap is None else {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": cap, "LRU_CACHE_CAPACITY": cap}))
        out = subprocess.run([sys.executable, "-c", _PRIMITIVES], env=e, capture_output=True, text=True, check=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        onednn, ideep, grew = out.stdout.split()
        runs[cap] = (onednn, ideep, float(grew))
    assert runs[None][:2] == ("64", "64") and runs["1024"][:2] == ("1024", "1024")
    assert runs[None][2] < 0.7 * runs["1024"][2], runs

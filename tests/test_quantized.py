"""Quantized checkpoints and --isq: format detection, the GGUF block quantizer against the `gguf`
package's bytes, the ISQ cache, and FP8-block / GPTQ / AWQ folders (written here from tiny random
Llamas) dequantized at load and compared with transformers on the same dequantized weights."""
import json
import os
import time

import gguf
import numpy as np
import pytest
import torch
import transformers as tf
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file

from bench.quant_writers import int_quant as _int_quant, pack_cols as _pack_cols, pack_rows as _pack_rows
from xinfer import Engine, EngineConfig, SamplingParams
from xinfer.errors import ModelLoadError
from xinfer.loader import isq, load_model_info
from xinfer.loader.dequant import (
    AWQ_ORDER,
    dequant_awq,
    dequant_fp8_block,
    dequant_gptq,
)
from xinfer.loader.quant_config import detect
from xinfer.models.layers import Linear

PROMPT = [3, 17, 42, 99, 5, 64, 23, 11, 7, 120, 31]


# ---- detection

@pytest.mark.parametrize("qc,named", [
    ({"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}, "MXFP4"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "W4A8_AWQ (modelopt)"),
    ({"quant_method": "compressed-tensors", "format": "marlin-24"}, "compressed-tensors marlin-24"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"format": "pack-quantized",
                                                                          "weights": {"num_bits": 2}}}},
     "pack-quantized (WNA16)"),
    ({"quant_method": "gptq", "bits": 3}, "gptq (3 bits)"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "awq (4 bits, gemv)"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
])
def test_unsupported_formats_are_named(tmp_path, qc, named):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                      "quantization_config": qc}))
    with pytest.raises(ModelLoadError) as e:
        load_model_info(str(tmp_path))  # the start-up path: before any tensor is read
    assert named in str(e.value) and "does not load" in str(e.value) and "fp8 with weight_block_size" in str(e.value)


def test_modelopt_side_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16}}))
    assert detect(str(tmp_path)).method == "nvfp4"


@pytest.mark.parametrize("qc,method,extra", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8", {"block": (128, 128)}),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "gptq", {"zero_offset": 1}),
    ({"quant_method": "gptq", "bits": 8, "checkpoint_format": "gptq_v2"}, "gptq", {"zero_offset": 0, "bits": 8}),
    ({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm", "zero_point": True}, "awq",
     {"group_size": 64}),
])
def test_supported_formats_detected(tmp_path, qc, method, extra):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
    s = detect(str(tmp_path))
    assert s.method == method and all(getattr(s, k) == v for k, v in extra.items())
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert detect(str(tmp_path)) is None


# ---- --isq: the quantizer against gguf.quants.quantize

def _hard_rows(rng):
    """Rows that hit the quantizers' edge cases: zero and constant blocks, +-max ties, exact .5
    rounding points, tiny and huge magnitudes, and plain normals."""
    rows = [np.zeros(64), np.full(64, 0.37), np.full(64, -2.0),
            np.r_[3.0, -3.0, rng.normal(size=30), -3.0, 3.0, rng.normal(size=30)],
            np.r_[127.0, np.arange(-62, 62) + 0.5][:64],  # q8_0: d = 1, so every value is a .5 tie
            np.r_[-8.0, rng.integers(-8, 8, 63) + 0.5],  # q4_0: d = 1 ties
            np.r_[0.0, 15.0, rng.integers(0, 15, 62) + 0.5],  # q4_1: d = 1 ties
            rng.normal(size=64) * 1e-6, rng.normal(size=64) * 1e4, rng.normal(size=64) * 1e-30]
    return np.concatenate([np.stack(rows), rng.normal(size=(300, 64)) * rng.uniform(0.01, 3, (300, 1))])


LEGACY = ("q8_0", "q4_0", "q4_1")  # the K-quants, which gguf cannot write, are tests/test_isq_kquant.py's


@pytest.mark.parametrize("fmt", LEGACY)
def test_isq_bytes_equal_gguf(fmt, monkeypatch):
    rng = np.random.default_rng(0)
    x = _hard_rows(rng).astype(np.float32)
    want = gguf.quants.quantize(x, Q[fmt.upper()])
    assert np.array_equal(isq.quantize(torch.from_numpy(x), fmt).numpy(), want)
    wide = rng.standard_t(3, size=(37, 96 * 32)).astype(np.float32)  # heavy tails, rows in several chunks
    monkeypatch.setattr(isq, "_CHUNK", 5 * 96 * 32)
    assert np.array_equal(isq.quantize(torch.from_numpy(wide), fmt).numpy(), gguf.quants.quantize(wide, Q[fmt.upper()]))


def test_isq_is_fast():
    w = torch.randn(4864, 896)  # a Qwen2.5-0.5B MLP projection
    for fmt in isq.FORMATS:
        took = []
        for _ in range(2):  # the better of two: other work shares these cores
            t0 = time.perf_counter()
            isq.quantize(w if fmt in LEGACY else w.T.contiguous(), fmt)  # K-quants: the down projection, 19 super-blocks a row
            took.append(time.perf_counter() - t0)
        per_weight = min(took) / w.numel()
        bound = 20 if fmt in LEGACY else 150  # llama.cpp's K-quant search fits 21 candidate scales a sub-block
        assert per_weight * 5e8 < bound, f"{fmt}: {per_weight * 5e8:.0f}s for 0.5B weights"


def test_isq_settings():
    with pytest.raises(ValueError, match=r"must be one of \['q8_0', 'q4_0', 'q4_1', 'q4_k', 'q6_k'\].*q5_0"):
        EngineConfig(isq="q5_0")
    with pytest.raises(ValueError, match="--quantization auto or gguf"):
        EngineConfig(isq="q8_0", quantization="none")
    assert EngineConfig(isq="Q4_1").isq == "q4_1"
    import argparse

    from xinfer.cli import add_engine_args, engine_config
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args(["--isq", "q4_0"])).isq == "q4_0"
    c = EngineConfig(isq="q8_0", device="cpu", dtype="bfloat16")
    with pytest.raises(ValueError, match="--isq q8_0: the kernels compute in float32"):
        c.resolve_quantization(False)


def _llama(hidden=64, inter=128, layers=2, vocab=128, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, eos_token_id=1,
                         **kw)
    model = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger than the init's 0.02 so that quantization error would show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _engine(path, **kw):
    return Engine(EngineConfig(model=str(path), num_kv_blocks=64, block_size=4, dtype="float32",
                               cpu_matmul="float32", **kw))


def _check(engine, ref, atol=1e-4):
    """Prompt log-probs in chunks of 3 rows (the block kernels' batch sizes) and greedy decoding
    against transformers' model `ref`."""
    got = engine.runner.log_probs(PROMPT, chunk=3)
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([PROMPT])).logits[0].float(), -1)
    assert (got - want).abs().max().item() < atol
    out = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].token_ids
    with torch.no_grad():
        ids = ref.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert out == ids[0, len(PROMPT):].tolist()
    return got


@pytest.fixture(scope="module")
def kernels():
    """Loaded (built) before a test points XINFER_CACHE_DIR elsewhere: the build is cached per process."""
    from ops import cpu_kernels
    if not cpu_kernels.available():
        pytest.skip("the CPU block kernels do not build here (no C compiler, or not x86-64): --isq needs them; "
                    "GPTQ, AWQ and tests/test_quant_formats.py check the float loading without them")


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory, kernels):
    model = _llama()
    path = tmp_path_factory.mktemp("isq_llama")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory, kernels):
    """Rows of 256 and 512 weights: whole K-quant super-blocks (the down projection's too)."""
    model = _llama(hidden=256, inter=512, layers=1)
    path = tmp_path_factory.mktemp("isq_wide_llama")
    model.save_pretrained(path)
    return path, model


@pytest.mark.parametrize("fmt", isq.FORMATS)
def test_isq_engine_matches_dequantized_transformers(float_llama, wide_llama, fmt, tmp_path, monkeypatch):
    monkeypatch.setenv("XINFER_CACHE_DIR", str(tmp_path))
    path, model = float_llama if fmt in LEGACY else wide_llama
    e = _engine(path, isq=fmt)
    m = e.runner.model
    assert all(lin.blocks is not None for lin in m.model.modules() if isinstance(lin, Linear))
    assert m.head_blocks is not None and m.head_blocks.kind == "q8"
    kinds = {"q4_k": ("q4", 1), "q6_k": ("q8", 2)}.get(fmt, (fmt[:2], 1))  # Q6_K: a scale per 16 weights
    assert {(lin.blocks.kind, lin.blocks.gs) for lin in m.model.modules() if isinstance(lin, Linear)} == {kinds}
    ref = _llama(**({} if fmt in LEGACY else dict(hidden=256, inter=512, layers=1)))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() == 2 and "embed_tokens" not in name:
                f = "q8_0" if name == "lm_head.weight" else fmt
                raw = isq.quantize(p, f).numpy()  # the K-quants' bytes: tests/test_isq_kquant.py holds them to llama.cpp's
                p.copy_(torch.from_numpy(gguf.quants.dequantize(raw, Q[f.upper()]).reshape(p.shape)))
    got = _check(e, ref)
    with torch.no_grad():  # and the blocks did the work: the float model is further away
        plain = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0], -1)
    assert (got - plain).abs().max().item() > 1e-3


def test_isq_cache(float_llama, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XINFER_CACHE_DIR", str(tmp_path / "cache"))
    src, _ = float_llama
    path = tmp_path / "model"
    path.mkdir()
    for f in src.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    first = _engine(path, isq="q4_1").runner.model
    cached = list((tmp_path / "cache" / "isq").glob("*.safetensors"))
    assert len(cached) == 1
    calls = []
    real = isq.quantize
    monkeypatch.setattr(isq, "quantize", lambda w, f: calls.append(f) or real(w, f))
    with caplog.at_level("INFO", logger="xinfer.loader"):
        second = _engine(path, isq="q4_1").runner.model
    assert calls == [] and any(f"read from {cached[0]}" in r.message for r in caplog.records)  # all cached
    a, b = first.model.layers[1].mlp.down_proj.blocks, second.model.layers[1].mlp.down_proj.blocks
    assert torch.equal(a.qs, b.qs) and torch.equal(a.d, b.d) and torch.equal(a.m, b.m)
    assert torch.equal(first.head_blocks.qs, second.head_blocks.qs)
    _engine(path, isq="q8_0")  # another format: its own entry
    assert len(calls) > 0 and len(list((tmp_path / "cache" / "isq").glob("*.safetensors"))) == 2
    calls.clear()
    st = path / "model.safetensors"
    os.utime(st, ns=(st.stat().st_atime_ns, st.stat().st_mtime_ns + 10**9))  # the checkpoint changed
    _engine(path, isq="q4_1")
    assert len(calls) > 0


# ---- FP8 blocks

def _fp8_blocks(w: torch.Tensor, block):
    """The format's quantizer: per [bs0, bs1] block, scale_inv = amax / 448 and fp8 = w / scale_inv."""
    n, k = w.shape
    rows, cols = -(-n // block[0]), -(-k // block[1])
    s = torch.empty(rows, cols)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            s[i, j] = blk.abs().max().clamp(min=1e-12) / 448.0
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (blk / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


def test_fp8_dequant_is_the_definition():
    torch.manual_seed(0)
    w = torch.randn(40, 72)
    block = (16, 32)  # neither dimension a multiple: partial edge blocks
    q, s = _fp8_blocks(w, block)
    got = dequant_fp8_block(q, s, block)
    for i in range(40):
        for j in range(0, 72, 7):
            assert got[i, j].item() == (q[i, j].float() * s[i // 16, j // 32]).item()
    assert (got - w).abs().max() < 0.07 * w.abs().max()


def _save_quantized(model, path, qc, convert):
    """Save `model` with every decoder linear replaced by convert(name, weight) -> {suffix: tensor}."""
    model.config.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, architectures=["LlamaForCausalLM"], quantization_config=qc)))
    state = {}
    for name, t in model.state_dict().items():
        if name.endswith("_proj.weight"):
            for suffix, v in convert(t).items():
                state[name[:-len("weight")] + suffix] = v.contiguous()
        else:
            state[name] = t.contiguous()
    names = sorted(state)
    half = len(names) // 2  # two shards, scales and weights apart for some linears
    save_file({n: state[n] for n in names[:half]}, str(path / "model-00001-of-00002.safetensors"))
    save_file({n: state[n] for n in names[half:]}, str(path / "model-00002-of-00002.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f"model-0000{1 + (i >= half)}-of-00002.safetensors" for i, n in enumerate(names)}}))


def _dequantized_ref(model, fn):
    ref = _llama()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("_proj.weight"):
                p.copy_(fn(p.data))
    return ref


def test_fp8_block_checkpoint(tmp_path, caplog, kernels, monkeypatch):
    monkeypatch.setenv("XINFER_CACHE_DIR", str(tmp_path / "cache"))
    block = (32, 32)
    model = _llama()
    path = tmp_path / "model"
    path.mkdir()
    _save_quantized(model, path, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": list(block)},
                    lambda w: dict(zip(("weight", "weight_scale_inv"), _fp8_blocks(w, block))))
    ref = _dequantized_ref(model, lambda w: dequant_fp8_block(*_fp8_blocks(w, block), block))
    with caplog.at_level("WARNING", logger="xinfer.loader"):
        e = _engine(path, quantization="none")
    assert any("fp8 weights dequantized at load" in r.message and "MiB resident in float32" in r.message
               for r in caplog.records)
    _check(e, ref)
    blocks = _engine(path, isq="q8_0").runner.model.model.layers[0].self_attn.qkv_proj.blocks
    assert blocks is not None and blocks.kind == "q8"  # and then quantized again for the kernels


# ---- GPTQ and AWQ, packed here from their definitions

def test_gptq_dequant_is_the_definition():
    rng = np.random.default_rng(1)
    for bits, v2 in ((4, False), (4, True), (8, False)):
        w = torch.randn(48, 128)
        q, z, s, g_idx, want = _int_quant(w, bits, 32, rng.permutation(128))
        stored = z if v2 else (z - 1) & ((1 << bits) - 1)  # v1: zero minus one, wrapped
        got = dequant_gptq(torch.from_numpy(_pack_rows(q, bits)), torch.from_numpy(_pack_cols(stored, bits)),
                           torch.from_numpy(s), torch.from_numpy(g_idx), bits, 32, 0 if v2 else 1)
        assert torch.allclose(got, want, atol=1e-6, rtol=0)


def test_awq_dequant_is_the_definition():
    w = torch.randn(40, 128)
    q, z, s, _, want = _int_quant(w, 4, 64)
    got = dequant_awq(torch.from_numpy(_pack_cols(q, 4, list(AWQ_ORDER))),
                      torch.from_numpy(_pack_cols(z, 4, list(AWQ_ORDER))), torch.from_numpy(s), 64)
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    plain = dequant_awq(torch.from_numpy(_pack_cols(q, 4)), torch.from_numpy(_pack_cols(z, 4)), torch.from_numpy(s), 64)
    assert not torch.allclose(plain, want, atol=1e-3)  # the packed order matters


@pytest.mark.parametrize("method", ["gptq", "gptq_act_order", "awq"])
def test_gptq_awq_checkpoints(tmp_path, method):
    model, group, rng = _llama(), 32, np.random.default_rng(2)
    act_order = method == "gptq_act_order"

    def convert(w):
        perm = rng.permutation(w.shape[1]) if act_order else None
        q, z, s, g_idx, _ = _int_quant(w, 4, group, perm)
        if method == "awq":
            return {"qweight": torch.from_numpy(_pack_cols(q, 4, list(AWQ_ORDER))),
                    "qzeros": torch.from_numpy(_pack_cols(z, 4, list(AWQ_ORDER))), "scales": torch.from_numpy(s)}
        return {"qweight": torch.from_numpy(_pack_rows(q, 4)), "qzeros": torch.from_numpy(_pack_cols((z - 1) & 15, 4)),
                "scales": torch.from_numpy(s), "g_idx": torch.from_numpy(g_idx)}
    state = rng.bit_generator.state
    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True} \
        if method == "awq" else {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order}
    _save_quantized(model, tmp_path, qc, convert)
    rng.bit_generator.state = state  # the same permutations again, for the reference
    ref = _dequantized_ref(model, lambda w: _int_quant(w, 4, group, rng.permutation(w.shape[1]) if act_order
                                                       else None)[4])
    _check(_engine(tmp_path, quantization="none"), ref)
    from ops import cpu_kernels
    if cpu_kernels.available():  # q4 blocks read in place, but not act-order's scattered groups
        e = _engine(tmp_path)
        kinds = [lin.blocks and lin.blocks.kind for lin in e.runner.model.model.modules() if isinstance(lin, Linear)]
        assert set(kinds) == ({None} if act_order else {"q4"})
        _check(e, ref)


def test_isq_quantizes_moe_experts(tmp_path, kernels, monkeypatch):
    """--isq on a Qwen3-MoE: every routed expert's gate-up and down blocks too, read per expert by
    a decode step; against transformers with those weights dequantized."""
    from tests.test_models import _make
    monkeypatch.setenv("XINFER_CACHE_DIR", str(tmp_path / "cache"))
    ref = _make("qwen3_moe")
    ref.save_pretrained(tmp_path / "moe")
    e = Engine(EngineConfig(model=str(tmp_path / "moe"), num_kv_blocks=64, block_size=4, dtype="float32",
                            cpu_matmul="float32", isq="q8_0"))
    experts = [m for m in e.runner.model.modules() if type(m).__name__ == "Experts"]
    assert experts and all(len(x.blocks["gate_up_proj"]) == x.gate_up_proj.shape[0] and x.blocks["down_proj"]
                           for x in experts)

    def q8(t):
        return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), Q.Q8_0), Q.Q8_0)).view(t.shape)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "embed_tokens" in name or "norm" in name or name.endswith("mlp.gate.weight"):
                continue  # not quantized: embeddings, norms and the router
            if p.dim() >= 2 and p.shape[-1] % 32 == 0:
                p.copy_(q8(p.data.reshape(-1, p.shape[-1])).view(p.shape))
    got = e.runner.log_probs(PROMPT, chunk=3)  # 3 rows a step: every expert's few rows read its blocks
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([PROMPT])).logits[0].float(), -1)
    assert (got - want).abs().max().item() < 1e-4

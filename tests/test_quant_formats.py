"""NVFP4 (ModelOpt and compressed-tensors), MXFP4, WNA16 (pack-quantized), per-tensor / per-channel
FP8 and INT8 checkpoints: each dequantizer against its format's definition (the quantizers here are
written from it), and each folder (a tiny random Llama) against transformers on the same
dequantized weights."""
import json

import pytest
import torch

from bench.quant_writers import ct as _ct, mxfp4 as _mxfp4, nvfp4 as _nvfp4, wna16 as _wna16
from ops import cpu_kernels
from tests.test_quantized import _check, _dequantized_ref, _engine, _llama, _save_quantized
from xinfer.models.layers import Linear
from xinfer.loader.dequant import E2M1, dequant_mxfp4, dequant_nvfp4, dequant_scaled, dequant_wna16, unpack_e2m1
from xinfer.loader.quant_config import detect

def test_e2m1_codes_and_nibble_order():
    assert unpack_e2m1(torch.tensor([[0x2F, 0x70]], dtype=torch.uint8)).tolist() == [[-6.0, 1.0, 0.0, 6.0]]


def test_nvfp4_and_mxfp4_are_the_definition():
    torch.manual_seed(0)
    w = torch.randn(24, 64)
    packed, scale, g = _nvfp4(w)
    got = dequant_nvfp4(packed, scale, g)
    codes = torch.stack([packed.long() & 15, packed.long() >> 4], -1).view(24, 64)
    for i, j in [(0, 0), (3, 17), (23, 63), (11, 32)]:
        assert got[i, j].item() == pytest.approx(E2M1[codes[i, j]] * scale[i, j // 16].float().item() * g.item(), rel=1e-6)
    assert (got - w).abs().max() < 0.3 * w.abs().max()
    packed, e = _mxfp4(w)
    got = dequant_mxfp4(packed, e)
    codes = torch.stack([packed.long() & 15, packed.long() >> 4], -1).view(24, 64)
    for i, j in [(0, 0), (5, 40), (23, 63)]:
        assert got[i, j].item() == E2M1[codes[i, j]] * 2.0 ** (int(e[i, j // 32]) - 127)
    assert (got - w).abs().max() < 0.3 * w.abs().max()


@pytest.mark.parametrize("bits,symmetric,act_order", [(4, True, False), (4, False, True), (8, True, False)])
def test_wna16_is_the_definition(bits, symmetric, act_order):
    torch.manual_seed(1)
    w = torch.randn(32, 128)
    perm = torch.randperm(128) if act_order else None
    parts, want = _wna16(w, bits, 32, symmetric, perm)
    got = dequant_wna16(parts["weight_packed"], parts["weight_scale"], parts.get("weight_zero_point"),
                        parts.get("weight_g_idx"), parts["weight_shape"], bits, 32)
    assert torch.equal(got, want)
    assert (got - w).abs().max() < (0.2 if bits == 4 else 0.02) * w.abs().max()


def test_scaled_per_tensor_channel_and_block():
    w = torch.randn(8, 64).to(torch.float8_e4m3fn)
    assert torch.equal(dequant_scaled(w, torch.tensor([0.5])), w.float() * 0.5)
    rows = torch.arange(1, 9, dtype=torch.float32)[:, None]
    assert torch.equal(dequant_scaled(w, rows), w.float() * rows)
    blocks = torch.tensor([[1.0, 2.0]])
    assert torch.equal(dequant_scaled(w, blocks, (8, 32))[:, 32:], w.float()[:, 32:] * 2)


def _cases():
    def nv_modelopt(w):
        p, s, g = _nvfp4(w)
        return {"weight": p, "weight_scale": s, "weight_scale_2": g, "input_scale": torch.tensor(1.0)}, \
            dequant_nvfp4(p, s, g)

    def nv_ct(w):
        p, s, g = _nvfp4(w)
        return {"weight_packed": p, "weight_scale": s, "weight_global_scale": (1 / g).reshape(1)}, \
            dequant_nvfp4(p, s, g)

    def mx(w):
        p, e = _mxfp4(w)
        return {"weight_packed": p, "weight_scale": e}, dequant_mxfp4(p, e)

    def fp8_channel(w):
        s = w.abs().amax(1, keepdim=True) / 448
        q = (w / s).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": s}, q.float() * s

    def int8_channel(w):
        s = w.abs().amax(1, keepdim=True) / 127
        q = torch.round(w / s).clamp(-128, 127).to(torch.int8)
        return {"weight": q, "weight_scale": s}, q.float() * s

    def fp8_tensor(w):
        s = w.abs().max() / 448
        q = (w / s).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": s.reshape(())}, q.float() * s

    def wna16(w):
        # act-order with zero points: the input columns permuted by a seeded, weight-shaped draw
        perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(w.shape[0]))
        return _wna16(w, 4, 32, False, perm)

    def wna16_plain(bits, symmetric, gs):
        return lambda w: _wna16(w, bits, gs, symmetric)

    return {
        "nvfp4_modelopt": ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}, nv_modelopt),
        "nvfp4_ct": (_ct("nvfp4-pack-quantized", {"num_bits": 4, "type": "float", "group_size": 16}), nv_ct),
        "mxfp4_ct": (_ct("mxfp4-pack-quantized", {"num_bits": 4, "type": "float", "group_size": 32}), mx),
        "wna16_ct": (_ct("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
                                            "symmetric": False, "actorder": "group"}), wna16),
        "wna16_asym_ct": (_ct("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
                                                 "symmetric": False}), wna16_plain(4, False, 32)),
        "wna16_8bit_ct": (_ct("pack-quantized", {"num_bits": 8, "type": "int", "strategy": "group", "group_size": 64,
                                                 "symmetric": True}), wna16_plain(8, True, 64)),
        "fp8_ct": (_ct("float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"}), fp8_channel),
        "int8_ct": (_ct("int-quantized", {"num_bits": 8, "type": "int", "strategy": "channel"}), int8_channel),
        "fp8_tensor": ({"quant_method": "fp8", "activation_scheme": "static"}, fp8_tensor),
    }


# formats the CPU block kernels read in place, and the blocks they become (kind, scales a block, offsets)
IN_PLACE = {"nvfp4_modelopt": ("q8", 2, False), "nvfp4_ct": ("q8", 2, False), "mxfp4_ct": ("q8", 1, False),
            "wna16_asym_ct": ("q4", 1, True), "wna16_8bit_ct": ("q8", 1, True)}


@pytest.mark.parametrize("name", sorted(_cases()))
def test_checkpoint_matches_transformers_on_the_dequantized_weights(tmp_path, name, caplog):
    qc, convert = _cases()[name]
    model = _llama()
    _save_quantized(model, tmp_path, qc, lambda w: convert(w)[0])
    assert detect(str(tmp_path)) is not None
    ref = _dequantized_ref(model, lambda w: convert(w)[1])
    with caplog.at_level("WARNING", logger="xinfer.loader"):
        _check(_engine(tmp_path, quantization="none"), ref)
    assert any("dequantized at load" in r.message for r in caplog.records)
    if name in IN_PLACE and cpu_kernels.available():  # the block kernels on the same weights, within float32 sums
        e = _engine(tmp_path)
        got = {(lin.blocks.kind, lin.blocks.gs, lin.blocks.m is not None)
               for lin in e.runner.model.model.modules() if isinstance(lin, Linear) and lin.blocks is not None}
        assert got == {IN_PLACE[name]}, got
        assert sum(isinstance(lin, Linear) for lin in e.runner.model.model.modules()) == sum(
            isinstance(lin, Linear) and lin.blocks is not None for lin in e.runner.model.model.modules())
        _check(e, ref)


def test_mixed_compressed_tensors_groups_are_refused(tmp_path):
    qc = _ct("pack-quantized", {"num_bits": 4})
    qc["config_groups"]["group_1"] = {"format": "float-quantized", "weights": {"num_bits": 8}}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
    with pytest.raises(Exception, match="does not load"):
        detect(str(tmp_path))


@pytest.mark.parametrize("fmt", ["nvfp4-pack-quantized", "mxfp4-pack-quantized", "pack-quantized-4-sym",
                                 "pack-quantized-4-asym", "pack-quantized-8-sym"])
def test_dequantizers_match_compressed_tensors(fmt):
    """compressed-tensors' own decompression of the same tensors gives our weights, rounded to the
    dtype it returns (its scales' dtype); and the block kernels' blocks hold those weights too."""
    ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (a test extra): "
                             "the dequantizers are still checked against the formats' definitions above")
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from xinfer.loader.dequant import blocks_of
    from xinfer.loader.quant_config import QuantScheme
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    if fmt.startswith("pack-quantized"):
        bits, sym = int(fmt.split("-")[2]), fmt.endswith("-sym")
        parts, _ = _wna16(w, bits, 32, sym)
        args = dict(num_bits=bits, type="int", strategy="group", group_size=32, symmetric=sym)
        ours = dequant_wna16(parts["weight_packed"], parts["weight_scale"], parts.get("weight_zero_point"), None,
                             parts["weight_shape"], bits, 32)
        scheme = QuantScheme("wna16", bits=bits, group_size=32)
        fmt = "pack-quantized"
        parts.setdefault("weight_zero_point", None)
        parts.setdefault("weight_g_idx", None)
    elif fmt.startswith("nvfp4"):
        p, s, g = _nvfp4(w)
        parts = {"weight_packed": p, "weight_scale": s, "weight_global_scale": (1 / g).reshape(1)}
        args = dict(num_bits=4, type="float", strategy="tensor_group", group_size=16)
        ours, scheme = dequant_nvfp4(p, s, 1 / parts["weight_global_scale"].float()), QuantScheme("nvfp4_ct")
    else:
        p, e = _mxfp4(w)
        parts = {"weight_packed": p, "weight_scale": e}
        args = dict(num_bits=4, type="float", strategy="group", group_size=32, scale_dtype=torch.uint8)
        ours, scheme = dequant_mxfp4(p, e), QuantScheme("mxfp4_ct")
    theirs = BaseCompressor.get_value_from_registry(fmt).decompress(
        {k: v for k, v in parts.items() if v is not None},
        QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**args)))["weight"]
    assert ct is not None and torch.equal(ours.to(theirs.dtype), theirs)
    assert torch.equal(blocks_of(scheme, parts).dequantize(), ours)

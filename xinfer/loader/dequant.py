"""Quantized HF checkpoints (FP8, GPTQ, AWQ, NVFP4, MXFP4, compressed-tensors): each quantized
linear becomes a float weight under its checkpoint name (`<prefix>.weight`), so the usual weight
loaders fuse QKV and gate-up shards as for a float checkpoint, and, where the format maps onto the
CPU block kernels' layouts exactly (`blocks_of`), also a QuantWeight that small batches read in
place, as they read a GGUF file's blocks:
- 4-bit GPTQ, AWQ and WNA16 with groups of a multiple of 32 and no act-order: q4 blocks,
  d = scale, m = -(scale * zero) (a float16 or bfloat16 scale times a 4-bit zero is exact in float32,
  so the kernel's fma(q, d, m) rounds scale * (q - zero) once, as the definition does);
- 8-bit ones: q8 blocks of q - 128 with m = scale * (128 - zero);
- NVFP4: q8 blocks of 2 * e2m1 (integers -12..12) with two scales a block, (scale * global) / 2;
- MXFP4: q8 blocks of 2 * e2m1 with d = 2^(e - 128).
FP8 and act-order groups stay float only; the memory the float weights cost is logged. `--isq`
turns any of them into GGUF blocks instead.

Each dequantizer follows its format's definition (W is [out, in] as `nn.Linear` holds it):
- fp8 blocks: W = fp8 * weight_scale_inv[i // bs0, j // bs1].
- GPTQ: qweight int32 [in / (32 / bits), out], values packed along `in`, lowest bits first;
  qzeros int32 [groups, out / (32 / bits)] packed along `out`; scales [groups, out];
  g_idx [in] (act-order: any group per input row; absent: row // group_size);
  W^T[k, n] = scales[g, n] * (q[k, n] - ((zeros[g, n] + zero_offset) mod 2^bits)), g = g_idx[k].
- AWQ (gemm): qweight int32 [in, out / 8], qzeros int32 [groups, out / 8], both packed along `out`
  with output column AWQ_ORDER[i] in bit slot i; W^T[k, n] = scales[g, n] * (q[k, n] - zeros[g, n]),
  g = k // group_size.
- scaled (fp8 without blocks, ModelOpt FP8, compressed-tensors float- and int-quantized): W = w * weight_scale,
  one scale per tensor, per output row ([out, 1]) or per `block` ([ceil(out / bs0), ceil(in / bs1)]).
- NVFP4 (ModelOpt; compressed-tensors nvfp4-pack-quantized): uint8 [out, in / 2], two E2M1 values a byte,
  the lower nibble first; weight_scale float8_e4m3 [out, in / 16]; W = e2m1 * (weight_scale * weight_scale_2)
  (ModelOpt) or * (weight_scale / weight_global_scale) (compressed-tensors keeps the reciprocal).
- MXFP4 (compressed-tensors mxfp4-pack-quantized): the same E2M1 bytes, weight_scale uint8 E8M0
  [out, in / 32]: W = e2m1 * 2^(weight_scale - 127).
- WNA16 (compressed-tensors pack-quantized): weight_packed int32 [out, in * bits / 32] packed along `in`,
  lowest bits first, each value stored plus 2^(bits - 1); weight_scale [out, groups]; asymmetric ones
  weight_zero_point int32 packed along `out` the same way; weight_g_idx [in] with act-order; weight_shape
  [out, in]. W[n, k] = (q[n, k] - z[n, g]) * scale[n, g], g = g_idx[k] or k // group_size, z = 2^(bits - 1)
  when symmetric.
"""
from __future__ import annotations

import logging

import torch

from ops.quant import QuantWeight
from xinfer.errors import ModelLoadError
from xinfer.loader import hf
from xinfer.loader.quant_config import QuantScheme

log = logging.getLogger("xinfer.loader")

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # bit slot i of a packed int32 holds output column AWQ_ORDER[i]


def dequant_fp8_block(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = w.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return w.float() * s


# E2M1 (FP4) code -> value: bit 3 the sign, then two exponent bits and one mantissa bit
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequant_scaled(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    n, k = w.shape
    s = scale.float()
    if s.numel() == 1:
        return w.float() * s.reshape(())
    if s.numel() == n:
        return w.float() * s.reshape(n, 1)
    if block is None:
        raise ValueError(f"scale of shape {tuple(s.shape)} for a [{n}, {k}] weight needs a block structure")
    return dequant_fp8_block(w, s, block)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., m] -> float32 [..., 2m], the lower nibble first."""
    b = packed.to(torch.uint8).to(torch.long)
    codes = torch.stack([b & 15, b >> 4], dim=-1).flatten(-2)
    return torch.tensor(E2M1)[codes]


def nvfp4_scales(scale, global_scale) -> torch.Tensor:
    """Each 16 weights' scale times the tensor's, in float32: the one rounding before the E2M1 value."""
    return scale.float() * torch.as_tensor(global_scale).float().reshape(())


def dequant_nvfp4(packed, scale, global_scale) -> torch.Tensor:
    return _fp4(unpack_e2m1(packed), nvfp4_scales(scale, global_scale), 16)


def mxfp4_scales(scale) -> torch.Tensor:
    return torch.exp2(scale.to(torch.uint8).float() - 127.0)


def dequant_mxfp4(packed, scale) -> torch.Tensor:
    return _fp4(unpack_e2m1(packed), mxfp4_scales(scale), 32)


def _fp4(v: torch.Tensor, d: torch.Tensor, per: int) -> torch.Tensor:
    """E2M1 values times their scale, one per `per` weights."""
    return v * d.repeat_interleave(per, 1)[:, :v.shape[1]]


def wna16_ints(packed, scale, zero_point, g_idx, shape, bits: int, group_size: int):
    """(q [N, K], zero points [N, G], each input column's group [K]) of a pack-quantized weight."""
    n, k = (int(x) for x in shape) if shape is not None else (packed.shape[0], packed.shape[1] * 32 // bits)
    q = unpack_int32(packed, bits, 1)[:, :k]
    if zero_point is None:
        z = torch.full((n, scale.shape[1]), 1 << (bits - 1), dtype=torch.int32)
    else:
        z = unpack_int32(zero_point, bits, 0)[:n]
    return q, z, _group_index(g_idx, k, group_size)


def dequant_wna16(packed, scale, zero_point, g_idx, shape, bits: int, group_size: int) -> torch.Tensor:
    return _apply(*wna16_ints(packed, scale, zero_point, g_idx, shape, bits, group_size), scale)


def _group_index(g_idx, k: int, group_size: int) -> torch.Tensor:
    return g_idx.long() if g_idx is not None else torch.arange(k) // (group_size if group_size > 0 else k)


def _apply(q: torch.Tensor, z: torch.Tensor, g: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """W [N, K] = s * (q - z), the scale and zero point of each input column's group g."""
    return ((q - z[:, g]).float() * s.float()[:, g]).contiguous()


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Each int32 holds 32 / bits values, the first in the lowest bits; spread them along `dim`."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    p = packed.to(torch.int32).unsqueeze(dim + 1)
    shape = [1] * p.dim()
    shape[dim + 1] = per
    q = (p >> shifts.view(shape)) & ((1 << bits) - 1)
    return q.flatten(dim, dim + 1)


def gptq_ints(qweight, qzeros, g_idx, bits: int, group_size: int, zero_offset: int):
    """(q [N, K], zero points [N, G], each input column's group [K]) of a GPTQ weight."""
    q = unpack_int32(qweight, bits, 0)  # [in, out]
    # v1's stored zero minus one wraps within `bits` (as AutoGPTQ reads it back): mask after the offset
    z = (unpack_int32(qzeros, bits, 1)[:, :q.shape[1]] + zero_offset) & ((1 << bits) - 1)
    return q.t(), z.t(), _group_index(g_idx, q.shape[0], group_size)


def dequant_gptq(qweight, qzeros, scales, g_idx, bits: int, group_size: int, zero_offset: int) -> torch.Tensor:
    return _apply(*gptq_ints(qweight, qzeros, g_idx, bits, group_size, zero_offset), scales.t())


def awq_ints(qweight, qzeros, group_size: int):
    """(q [N, K], zero points [N, G], each input column's group [K]) of an AWQ weight."""
    q = _awq_columns(unpack_int32(qweight, 4, 1))
    return q.t(), _awq_columns(unpack_int32(qzeros, 4, 1)).t(), _group_index(None, q.shape[0], group_size)


def dequant_awq(qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    return _apply(*awq_ints(qweight, qzeros, group_size), scales.t())


def _awq_columns(slots: torch.Tensor) -> torch.Tensor:
    """Bit-slot order to output-column order within each group of eight columns."""
    inverse = [AWQ_ORDER.index(c) for c in range(8)]
    n = slots.shape[1]
    idx = (torch.arange(n).view(-1, 8)[:, inverse]).reshape(-1)
    return slots[:, idx]


class _Shards:
    """Every tensor of the folder by name, read on demand (a weight and its scales may sit in
    different shards, in any order)."""

    def __init__(self, folder: str):
        from safetensors import safe_open
        self.where, self._files = {}, []
        for path in hf.safetensors_files(folder):
            try:
                f = safe_open(str(path), framework="pt")
            except Exception as e:  # the reader raises several types for a bad header
                raise ModelLoadError(f"corrupt safetensors file {path}: {e}") from None
            self._files.append(f)
            for name in f.keys():
                self.where[name] = (f, path)

    def get(self, name: str) -> torch.Tensor:
        f, path = self.where[name]
        try:
            return f.get_tensor(name)
        except Exception as e:
            raise ModelLoadError(f"corrupt safetensors file {path}: {e}") from None

    def opt(self, name: str):
        return self.get(name) if name in self.where else None


# method -> (the tensor that marks a quantized linear, every tensor of one, the required ones first;
# how many are required)
FORMATS = {
    "fp8": (("weight_scale_inv", "weight", "input_scale"), 2),
    "scaled": (("weight_scale", "weight", "input_scale"), 2),
    "gptq": (("qweight", "qzeros", "scales", "g_idx"), 3),
    "awq": (("qweight", "qzeros", "scales"), 3),
    "nvfp4": (("weight_scale_2", "weight", "weight_scale", "input_scale"), 3),
    "nvfp4_ct": (("weight_global_scale", "weight_packed", "weight_scale", "input_global_scale"), 3),
    "mxfp4_ct": (("weight_packed", "weight_scale"), 2),
    "wna16": (("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape"), 2),
}


def convert(scheme: QuantScheme, p: dict, want_blocks: bool) -> tuple[torch.Tensor, QuantWeight | None]:
    """A quantized linear's stored tensors -> (its float weight, and where asked and its layout maps
    onto them, the CPU block kernels' blocks of the same weights; see the module docstring)."""
    m = scheme.method
    if m == "fp8":
        return dequant_fp8_block(p["weight"], p["weight_scale_inv"], scheme.block), None
    if m == "scaled":
        return dequant_scaled(p["weight"], p["weight_scale"], scheme.block), None
    if m in ("nvfp4", "nvfp4_ct", "mxfp4_ct"):
        v = unpack_e2m1(p["weight"] if m == "nvfp4" else p["weight_packed"])
        per = 32 if m == "mxfp4_ct" else 16
        d = (mxfp4_scales(p["weight_scale"]) if m == "mxfp4_ct" else
             nvfp4_scales(p["weight_scale"], p["weight_scale_2"] if m == "nvfp4" else 1.0 / p["weight_global_scale"].float()))
        return _fp4(v, d, per), _fp4_blocks(v, d, per) if want_blocks else None
    if m == "gptq":
        ints, s = gptq_ints(p["qweight"], p["qzeros"], p["g_idx"], scheme.bits, scheme.group_size,
                            scheme.zero_offset), p["scales"].t()
    elif m == "awq":
        ints, s = awq_ints(p["qweight"], p["qzeros"], scheme.group_size), p["scales"].t()
    else:
        s = p["weight_scale"]
        ints = wna16_ints(p["weight_packed"], s, p["weight_zero_point"], p["weight_g_idx"], p["weight_shape"],
                          scheme.bits, scheme.group_size)
    q, z, g = ints
    grouped = torch.equal(g, _group_index(None, q.shape[1], scheme.group_size))  # act-order scatters groups
    blocks = _int_blocks(q, s, z, 4 if m == "awq" else scheme.bits, scheme.group_size) if want_blocks and grouped else None
    return _apply(q, z, g, s), blocks


def _groups(s: torch.Tensor, k: int, group_size: int) -> torch.Tensor | None:
    """[N, G] group scales -> [N, k / 32], one per 32-weight block; None where groups cut blocks."""
    g = group_size if group_size > 0 else k
    if k % 32 or g % 32 or s.shape[1] != -(-k // g):
        return None
    return s.float().repeat_interleave(g // 32, 1)[:, :k // 32].contiguous()


def _int_blocks(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int, group_size: int):
    """q [N, K] integers 0 .. 2^bits - 1, scales s and zero points z [N, G]: W = s * (q - z)."""
    n, k = q.shape
    d, zb = _groups(s, k, group_size), _groups(z, k, group_size)
    if d is None or bits not in (4, 8):
        return None
    if bits == 4:
        b = q.to(torch.uint8).reshape(n, k // 32, 2, 16)
        qs = (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
        return QuantWeight("q4", qs, d, -(d * zb), (n, k))
    return QuantWeight("q8", (q - 128).to(torch.int8).contiguous(), d, d * (128 - zb), (n, k))


def _fp4_blocks(v: torch.Tensor, d: torch.Tensor, per: int):
    """E2M1 values as q8 blocks of 2 * value (integers -12 .. 12) with d = scale / 2 per `per` weights."""
    n, k = v.shape
    if k % 32 or d.shape[1] * per < k:
        return None
    return QuantWeight("q8", (v * 2).to(torch.int8), (d[:, :k // per] / 2).contiguous(), None, (n, k), 32 // per)


def blocks_of(scheme: QuantScheme, p: dict) -> QuantWeight | None:
    """The linear as the CPU block kernels' blocks, or None where its layout does not map onto them."""
    return convert(scheme, p, True)[1]


def iter_dequantized(folder: str, scheme: QuantScheme, dtype: torch.dtype, blocks: list | None = None,
                     keep=None):
    """(name, tensor) as iter_safetensors yields them, each quantized linear as a float `.weight`;
    `blocks` (a list) also collects (name, QuantWeight) of those the block kernels read in place;
    `keep(name)`: only those (a pipeline stage's)."""
    shards = _Shards(folder)
    names, required = FORMATS[scheme.method]
    key = "." + names[0]
    prefixes = {n[:-len(key)] for n in shards.where if n.endswith(key)}
    skip = {f"{p}.{c}" for p in prefixes for c in names}
    stored = dense = 0
    for name in shards.where:
        if keep is not None and not keep(name):
            continue
        if name.endswith(key):
            prefix = name[:-len(key)]
            parts = {c: shards.opt(f"{prefix}.{c}") for c in names}
            try:
                missing = [c for c in names[:required] if parts[c] is None]
                if missing:
                    raise ValueError(f"{', '.join(missing)} missing")
                w, q = convert(scheme, parts, blocks is not None)
            except (KeyError, ValueError, RuntimeError, IndexError, TypeError) as e:
                raise ModelLoadError(f"{scheme.method} weight {prefix}: {type(e).__name__}: {e}") from None
            stored += sum(t.numel() * t.element_size() for t in parts.values() if t is not None)
            dense += w.numel() * torch.tensor([], dtype=dtype).element_size()
            if q is not None and q.shape == tuple(w.shape):
                blocks.append((f"{prefix}.weight", q))
            yield f"{prefix}.weight", w
        elif name in skip:
            continue  # read with its quantized weight
        else:
            yield name, shards.get(name)
    if dense:
        log.warning("%s weights dequantized at load: %s resident in %s (for batches the block kernels do not "
                    "take) beside the checkpoint's %s", scheme.method, size(dense), str(dtype).removeprefix("torch."),
                    size(stored))


def size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"

"""Quantized HF checkpoints (FP8 blocks, GPTQ, AWQ) dequantized once at load into float weights.

No kernel here reads these formats in place, so each quantized linear becomes an ordinary float
weight under its checkpoint name (`<prefix>.weight`) and the usual weight loaders fuse QKV and
gate-up shards as for a float checkpoint; the memory that costs is logged. `--isq` can turn the
result into GGUF blocks again for the CPU kernels.

Each dequantizer follows its format's definition (W is [out, in] as `nn.Linear` holds it):
- fp8 blocks: W = fp8 * weight_scale_inv[i // bs0, j // bs1].
- GPTQ: qweight int32 [in / (32 / bits), out], values packed along `in`, lowest bits first;
  qzeros int32 [groups, out / (32 / bits)] packed along `out`; scales [groups, out];
  g_idx [in] (act-order: any group per input row; absent: row // group_size);
  W^T[k, n] = scales[g, n] * (q[k, n] - ((zeros[g, n] + zero_offset) mod 2^bits)), g = g_idx[k].
- AWQ (gemm): qweight int32 [in, out / 8], qzeros int32 [groups, out / 8], both packed along `out`
  with output column AWQ_ORDER[i] in bit slot i; W^T[k, n] = scales[g, n] * (q[k, n] - zeros[g, n]),
  g = k // group_size.
"""
from __future__ import annotations

import logging

import torch

from xinfer.errors import ModelLoadError
from xinfer.loader import hf
from xinfer.loader.quant_config import QuantScheme

log = logging.getLogger("xinfer.loader")

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # bit slot i of a packed int32 holds output column AWQ_ORDER[i]


def dequant_fp8_block(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = w.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return w.float() * s


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Each int32 holds 32 / bits values, the first in the lowest bits; spread them along `dim`."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    p = packed.to(torch.int32).unsqueeze(dim + 1)
    shape = [1] * p.dim()
    shape[dim + 1] = per
    q = (p >> shifts.view(shape)) & ((1 << bits) - 1)
    return q.flatten(dim, dim + 1)


def dequant_gptq(qweight, qzeros, scales, g_idx, bits: int, group_size: int, zero_offset: int) -> torch.Tensor:
    q = unpack_int32(qweight, bits, 0)  # [in, out]
    k = q.shape[0]
    if g_idx is None:
        g_idx = torch.arange(k) // (group_size if group_size > 0 else k)
    g = g_idx.long()
    # v1's stored zero minus one wraps within `bits` (as AutoGPTQ reads it back): mask after the offset
    z = (unpack_int32(qzeros, bits, 1)[:, :q.shape[1]] + zero_offset) & ((1 << bits) - 1)
    w = scales.float()[g] * (q - z[g]).float()
    return w.t().contiguous()


def dequant_awq(qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    q = _awq_columns(unpack_int32(qweight, 4, 1))
    z = _awq_columns(unpack_int32(qzeros, 4, 1))
    k = q.shape[0]
    g = torch.arange(k) // (group_size if group_size > 0 else k)
    w = scales.float()[g] * (q - z[g]).float()
    return w.t().contiguous()


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


def _companions(scheme: QuantScheme, prefix: str) -> list[str]:
    if scheme.method == "fp8":
        return [f"{prefix}.weight_scale_inv", f"{prefix}.input_scale"]
    return [f"{prefix}.{s}" for s in ("qweight", "qzeros", "scales", "g_idx")]


def iter_dequantized(folder: str, scheme: QuantScheme, dtype: torch.dtype):
    """(name, tensor) as iter_safetensors yields them, each quantized linear as a float `.weight`."""
    shards = _Shards(folder)
    key = ".weight_scale_inv" if scheme.method == "fp8" else ".qweight"
    prefixes = {n[:-len(key)] for n in shards.where if n.endswith(key)}
    skip = {c for p in prefixes for c in _companions(scheme, p)}
    stored = dense = 0
    for name in shards.where:
        if name.endswith(key):
            prefix = name[:-len(key)]
            parts = [shards.opt(c) for c in _companions(scheme, prefix)]
            w = _dequant(scheme, prefix, shards, parts)
            stored += sum(t.numel() * t.element_size() for t in parts if t is not None)
            if scheme.method == "fp8":
                stored += w.numel()  # the float8 weight itself, one byte each
            dense += w.numel() * torch.tensor([], dtype=dtype).element_size()
            yield f"{prefix}.weight", w
        elif name in skip or (scheme.method == "fp8" and name.endswith(".weight") and name[:-7] in prefixes):
            continue  # read with its quantized weight
        else:
            yield name, shards.get(name)
    if dense:
        log.warning("%s weights dequantized at load (no kernel reads them in place): %s resident in %s "
                    "instead of the checkpoint's %s", scheme.method, size(dense), str(dtype).removeprefix("torch."),
                    size(stored))


def size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def _dequant(scheme: QuantScheme, prefix: str, shards: _Shards, parts) -> torch.Tensor:
    try:
        if scheme.method == "fp8":
            return dequant_fp8_block(shards.get(f"{prefix}.weight"), parts[0], scheme.block)
        qweight, qzeros, scales, g_idx = parts
        if qzeros is None or scales is None:
            raise ValueError("qzeros or scales missing")
        if scheme.method == "gptq":
            return dequant_gptq(qweight, qzeros, scales, g_idx, scheme.bits, scheme.group_size, scheme.zero_offset)
        return dequant_awq(qweight, qzeros, scales, scheme.group_size)
    except (KeyError, ValueError, RuntimeError, IndexError) as e:
        raise ModelLoadError(f"{scheme.method} weight {prefix}: {type(e).__name__}: {e}") from None

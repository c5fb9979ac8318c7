"""A whole decode step of a Llama-shaped decoder in one C call (`xinfer_decode`, ops/cpu_kernels.c).

At one to a few sequences a step does little arithmetic, and driving ~300 torch ops for it cost
about as much as the matmuls (bench/NOTES-cpu.md). The C step runs the same kernels in one OpenMP
region. The model decides which of its layers fit (xinfer/models/llama.py) and hands over plain
tensors; this module only lays them out for C. XINFER_CPU_DECODE=0 keeps the op-by-op path.
"""
from __future__ import annotations

import ctypes

import torch

from ops import envs, kv_quant
from ops.cpu_kernels import lib
from ops.qgemm import Bf16Weight, PackedWeight
from ops.quant import QuantWeight

ENABLED = envs.cpu_decode()
_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


ACTS = {"silu": 0, "gelu_pytorch_tanh": 1}  # the gate activations the C step computes


class _Linear(ctypes.Structure):
    _fields_ = [("qs", _P), ("d", _P), ("m", _P), ("bias", _P), ("kind", _I), ("N", _I), ("K", _I), ("gs", _I),
                ("prec", _I), ("pq", _P), ("pd", _P), ("pm", _P), ("pi", _P), ("qg", _P)]


class _Packed(ctypes.Structure):  # ops/cpu_qgemm.c qg_linear
    _fields_ = [("n_parts", _I), ("kind", _I * 3), ("N", _I * 3), ("pw", _P * 3)]


class _Layer(ctypes.Structure):
    _fields_ = [("ln_in", _P), ("ln_post", _P), ("q_norm", _P), ("k_norm", _P), ("attn_out_norm", _P),
                ("mlp_out_norm", _P), ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("k_cache", _P), ("v_cache", _P), ("k_scale", _P), ("v_scale", _P), ("levels", _P), ("mids", _P),
                ("rotation", _P), ("k_shift", _P), ("kv_bits", _I), ("cos", _P), ("sin", _P),
                ("rot", _I), ("window", _I), ("kv_kind", _I), ("act", _I), ("scale", _F), ("softcap", _F)]


class _Model(ctypes.Structure):
    _fields_ = [("n_layers", _I), ("H", _I), ("Hq", _I), ("Hkv", _I), ("D", _I), ("inter", _I), ("bs", _I),
                ("eps", _F), ("offset", _F), ("final_norm", _P), ("layers", ctypes.POINTER(_Layer))]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _linear(w: QuantWeight | PackedWeight | Bf16Weight, bias: torch.Tensor | None, keep: list) -> _Linear:
    n, k = w.shape
    if isinstance(w, Bf16Weight):  # cpu_kernels.c: kind 2, PREC_BF16, the panels
        return _Linear(None, None, None, _ptr(bias), 2, n, k, 1, 1, _ptr(w.panels), None, None, None, None)
    if isinstance(w, PackedWeight):
        if len(w.parts) > 3:
            raise ValueError("more than three packed parts")
        p = _Packed(len(w.parts), (_I * 3)(*[kind for kind, _, _ in w.parts]), (_I * 3)(*[rows for _, rows, _ in w.parts]),
                    (_P * 3)(*[t.data_ptr() for _, _, t in w.parts]))
        keep.append(p)
        return _Linear(None, None, None, _ptr(bias), 0, n, k, 1, 0, None, None, None, None, ctypes.addressof(p))
    pq, pd, pm = w.panels or (None, None, None)
    return _Linear(_ptr(w.qs), _ptr(w.d), _ptr(w.m), _ptr(bias), 0 if w.kind == "q4" else 1, n, k, w.gs,
                   w.prec, _ptr(pq), _ptr(pd), _ptr(pm), _ptr(w.wide))


class CpuDecoder:
    """`layers`: one dict a layer with ln_in, ln_post, q_norm, k_norm (or None) weights, optionally
    attn_out_norm and mlp_out_norm (Gemma 3) and act (a key of ACTS; silu); qkv, o, gate_up, down as
    (QuantWeight, PackedWeight or Bf16Weight, bias or None); k_cache, v_cache (in any format kv_quant.c_kind names); cos, sin,
    rot; window (0: none), scale, softcap (0: none). Every other tensor is float32, contiguous and on the
    CPU, and is kept alive here."""

    def __init__(self, layers: list[dict], final_norm: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_dim: int, eps: float, offset: float):
        self._keep = [final_norm] + layers  # C holds raw pointers into these
        arr = (_Layer * len(layers))()
        for i, ly in enumerate(layers):
            turbo = kv_quant.turbo_args(ly["k_cache"])
            self._keep.append(turbo)
            arr[i] = _Layer(_ptr(ly["ln_in"]), _ptr(ly["ln_post"]), _ptr(ly["q_norm"]), _ptr(ly["k_norm"]),
                            _ptr(ly.get("attn_out_norm")), _ptr(ly.get("mlp_out_norm")),
                            *(_linear(*ly[k], self._keep) for k in ("qkv", "o", "gate_up", "down")),
                            _ptr(ly["k_cache"]), _ptr(ly["v_cache"]), _ptr(kv_quant.scales(ly["k_cache"])),
                            _ptr(kv_quant.scales(ly["v_cache"])), *map(_ptr, turbo[1:]), turbo[0], _ptr(ly["cos"]),
                            _ptr(ly["sin"]), ly["rot"], ly["window"], kv_quant.c_kind(ly["k_cache"]),
                            ACTS[ly.get("act", "silu")],
                            ly["scale"], ly["softcap"])
        self._layers = arr  # _Model points at it
        self.caches = [(ly["k_cache"], ly["v_cache"]) for ly in layers]
        # the largest batch it takes: where its slowest weights' kernels give way to the GEMMs
        self.max_rows = min(ly[k][0].max_rows for ly in layers for k in ("qkv", "o", "gate_up", "down"))
        self._model = _Model(len(layers), final_norm.shape[0], num_heads, num_kv_heads, head_dim,
                             layers[0]["gate_up"][0].shape[0] // 2, layers[0]["k_cache"].shape[1], eps, offset,
                             _ptr(final_norm), arr)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """x [B, H] embedded tokens (each row a decode: AttnMetadata.row_decode); returns the final
        norm's output [B, H]."""
        x, positions = x.contiguous(), positions.to(torch.int64).contiguous()  # C reads int64 positions
        out = torch.empty_like(x)
        tables, lens = meta.row_decode()
        lib().xinfer_decode(ctypes.byref(self._model), x.data_ptr(), out.data_ptr(), x.shape[0], positions.data_ptr(),
                            meta.slot_mapping.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr())
        return out

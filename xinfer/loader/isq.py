"""--isq: quantize a float checkpoint's linear weights to GGUF blocks at load, so HF models run on
the same CPU block kernels (ops/quant.py) as a quantized GGUF file.

The legacy quantizers give the bytes the `gguf` package's `gguf.quants.quantize` gives for the same
float32 input (tests/test_quantized.py holds them to that): the same float32 numpy operations in the
same order, a chunk of rows at a time so the temporaries stay in cache (numpy, not torch: torch's
thread pool, forking and joining per small op, ran 30x slower whenever another process held a core).
The K-quants, which gguf cannot write, are llama.cpp's reference quantizers (xinfer/loader/kquant.py);
a weight whose rows are not whole 256-weight super-blocks falls back as llama-quantize does (q4_k to
Q5_0, q6_k to Q8_0). The blocks are cached on disk, keyed by the checkpoint's files (names, sizes,
mtimes) and the format, so a second start skips the work.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from ops import qgemm
from ops.quant import QuantWeight
from xinfer import envs
from xinfer.config import ISQ_FORMATS
from xinfer.loader import hf, kquant
from xinfer.loader.dequant import size
from ops.block_types import BLOCK_TYPES

log = logging.getLogger("xinfer.loader")

FORMATS = ISQ_FORMATS  # the block types the CPU kernels read
HEAD_FORMAT = "q8_0"  # the output head keeps 8 bits whatever --isq says: llama.cpp's choice too
_VERSION = 1  # bump when the blocks for the same input change
_CHUNK = 1 << 16  # weights quantized at once: temporaries that stay in cache


def _inverse(d: np.ndarray) -> np.ndarray:
    return np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)


def _half_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[blocks, 32] values 0..15 -> [blocks, 16] bytes: the first 16 low, the last 16 high."""
    q = q.astype(np.uint8).reshape(-1, 2, 16)
    return q[:, 0] | (q[:, 1] << np.uint8(4))


def _q8_0(b: np.ndarray) -> np.ndarray:
    d = np.abs(b).max(-1, keepdims=True) / np.float32(127)
    x = b * _inverse(d)
    a = np.abs(x)
    f = np.floor(a)
    q = np.sign(x) * (f + np.floor(np.float32(2) * (a - f)))  # round half away from zero
    return np.concatenate([_half_bytes(d), q.astype(np.int8).view(np.uint8)], -1)


def _q4_0(b: np.ndarray) -> np.ndarray:
    mx = np.take_along_axis(b, np.abs(b).argmax(-1, keepdims=True), -1)  # the signed value of largest magnitude
    d = mx / np.float32(-8)
    q = np.trunc(b * _inverse(d) + np.float32(8.5)).clip(0, 15)
    return np.concatenate([_half_bytes(d), _nibbles(q)], -1)


def _q4_1(b: np.ndarray) -> np.ndarray:
    mx, mn = b.max(-1, keepdims=True), b.min(-1, keepdims=True)
    d = (mx - mn) / np.float32(15)
    q = np.trunc((b - mn) * _inverse(d) + np.float32(0.5)).clip(0, 15)
    return np.concatenate([_half_bytes(d), _half_bytes(mn), _nibbles(q)], -1)


def _q5_0(b: np.ndarray) -> np.ndarray:
    return gguf_quantize(b, GGMLQuantizationType.Q5_0).reshape(len(b), -1)


_QUANT = {"q8_0": _q8_0, "q4_0": _q4_0, "q4_1": _q4_1, "q5_0": _q5_0, "q4_k": kquant.q4_k, "q6_k": kquant.q6_k}
_FALLBACK = {"q4_k": "q5_0", "q6_k": "q8_0"}  # llama-quantize's, for rows that are not whole super-blocks


def block_format(fmt: str, k: int) -> str:
    """The format a weight with rows of k weights gets for --isq `fmt`."""
    return _FALLBACK[fmt] if fmt in _FALLBACK and k % 256 else fmt


def quantize(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """[N, K] float (K a multiple of the format's block) -> [N, K / block * block bytes] uint8, GGUF's bytes."""
    n, k = w.shape
    size = BLOCK_TYPES[fmt.upper()][0]
    if k % size:
        raise ValueError(f"{fmt} needs rows of a multiple of {size} weights, got {k}")
    fn, rows = _QUANT[fmt], max(1, _CHUNK // k)
    out = [fn(w[i:i + rows].float().numpy().reshape(-1, size)).reshape(min(rows, n - i), -1) for i in range(0, n, rows)]
    return torch.from_numpy(np.concatenate(out)) if out else torch.empty(0, dtype=torch.uint8)


def targets(model, fmt: str) -> dict[str, tuple[object, str]]:
    """{parameter name: (the module or model that takes its blocks, format)}: every Linear whose rows
    split into 32-weight blocks, and the output head."""
    from xinfer.models.layers import Linear
    from xinfer.models.moe import Experts
    out = {f"{n}.weight": (m, block_format(fmt, m.weight.shape[1])) for n, m in model.named_modules()
           if isinstance(m, Linear) and m.weight.dim() == 2 and m.weight.shape[1] % 32 == 0}
    for n, m in model.named_modules():  # routed experts: each stack quantized as rows, read per expert
        if isinstance(m, Experts):
            out.update({f"{n}.{p}": (m, block_format(fmt, getattr(m, p).shape[2])) for p in ("gate_up_proj", "down_proj")
                        if getattr(m, p).shape[2] % 32 == 0})
    head = getattr(model, "head_param_name", None)
    if head is not None and dict(model.named_parameters())[head()].shape[1] % 32 == 0:
        out[head()] = (model, HEAD_FORMAT)
    return out


def cache_key(folder: str, fmt: str) -> str:
    files = [Path(folder) / "config.json"] + hf.safetensors_files(folder)
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return hashlib.sha256(json.dumps([_VERSION, fmt, str(Path(folder).resolve()), stats]).encode()).hexdigest()[:32]


def apply_isq(model, fmt: str, folder: str | None, held: bool = False) -> int:
    """Attach GGUF blocks in `fmt` to every target weight of `model`; `folder`: the checkpoint,
    whose blocks are cached (None: a model with random weights, never cached). `held`: Q4_K / Q6_K /
    Q8_0 blocks of Linears and the head are held alone (ops/qgemm.py) and their float weights freed.
    Returns how many weights got blocks."""
    t0 = time.monotonic()
    want = targets(model, fmt)
    params = dict(model.named_parameters())
    path = Path(envs.cache_dir()) / "isq" / f"{cache_key(folder, fmt)}.safetensors" if folder else None
    blocks = _read_cache(path, want, params) if path else None
    hit = blocks is not None
    if not hit:
        blocks = {name: quantize(params[name].data.flatten(0, -2), f) for name, (_, f) in want.items()}
        if path:
            _write_cache(path, blocks)
    n_held = 0
    for name, (owner, f) in want.items():
        shape = _rows(params[name])
        if held and not hasattr(owner, "attach") and qgemm.fits(f.upper(), shape):
            q = qgemm.PackedWeight.from_gguf(f.upper(), blocks[name].numpy(), shape)
            tied = owner is model and getattr(model, "tied", False)
            if not tied:  # a tied head's table stays for the embedding
                params[name].data = torch.empty(0, dtype=params[name].dtype)
            n_held += 1
        else:
            q = QuantWeight.from_gguf(f.upper(), blocks[name].numpy(), shape)
        if owner is model:
            model.head_blocks = q
        elif hasattr(owner, "attach"):  # experts
            owner.attach(name.rsplit(".", 1)[1], q)
        else:
            owner.blocks = q
    if n_held:
        log.info("--isq %s: %d weights held as blocks alone (8-bit activations, VNNI), no float copy", fmt, n_held)
    log.info("--isq %s: %d weights as GGUF blocks (head %s, %s beside the float weights), %s in %.1fs", fmt,
             len(want), HEAD_FORMAT, size(sum(b.numel() for b in blocks.values())),
             f"read from {path}" if hit else "quantized" + (f", cached in {path}" if path else ""),
             time.monotonic() - t0)
    return len(want)


def _rows(p: torch.Tensor) -> tuple[int, int]:
    """A weight as the rows its blocks hold: experts' stacks [E, N, K] as [E * N, K]."""
    return (p.numel() // p.shape[-1], p.shape[-1])


def _read_cache(path: Path, want: dict, params: dict) -> dict | None:
    if not path.is_file():
        return None
    from safetensors.torch import load_file
    try:
        got = load_file(str(path))
    except Exception as e:  # a truncated or foreign file: quantize again
        log.warning("ignoring unreadable --isq cache %s: %s", path, e)
        return None
    for name, (_, f) in want.items():
        shape = _rows(params[name])
        size, nbytes = BLOCK_TYPES[f.upper()]
        if name not in got or tuple(got[name].shape) != (shape[0], shape[1] // size * nbytes):
            return None
    return got


def _write_cache(path: Path, blocks: dict) -> None:
    from safetensors.torch import save_file
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file({k: v.contiguous() for k, v in blocks.items()}, str(tmp))
        os.replace(tmp, path)  # readers never see a half-written file
    except OSError as e:
        log.warning("could not cache --isq blocks in %s: %s", path, e)

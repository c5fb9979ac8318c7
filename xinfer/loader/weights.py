"""Building a model and loading its weights (the only part of the loader that needs torch)."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from xinfer import parallel as tp
from xinfer.errors import ModelLoadError
from xinfer.loader import ModelInfo, hf
from xinfer.loader.dequant import iter_dequantized
from xinfer.models import model_class

log = logging.getLogger("xinfer.loader")


def build_model(info: ModelInfo, dtype: torch.dtype, device: torch.device, blocks: list | None = None,
                held=None) -> torch.nn.Module:
    """`blocks`: a list that collects a quantized HF checkpoint's linears the CPU block kernels read
    in place, (name, QuantWeight), beside their float weights. `held(model)`: gives the built model
    the weights it holds in another form before any is read, and returns their checkpoint names,
    which are then not read in float (ops/qgemm.py)."""
    cls = model_class(info.config)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(info.config)
    finally:
        torch.set_default_dtype(prev)
    skip = held(model) if held is not None else set()
    if info.kind == "dummy":
        _random_init(model)
    else:
        keep = getattr(model, "keeps", None)  # pipeline parallel: this stage's tensors only
        lazy = tp.size() > 1  # tensor parallel: each rank reads its part of a tensor, not the whole
        if info.kind == "gguf":
            weights = info.gguf.tensors(keep, lazy, skip)
        elif info.quant is not None:
            weights = iter_dequantized(info.path, info.quant, dtype, blocks, keep)
        else:
            weights = hf.iter_safetensors(info.path, keep, lazy, skip)
        try:
            model.load_weights(_progress(weights, info.path))
        except (KeyError, ValueError) as e:
            raise ModelLoadError(f"weights of {info.path} do not fit {cls.__name__}: {e}") from None
    return model.eval()


def gguf_held(gguf):
    """build_model's `held` for a quantized GGUF on the fast path: its Q4_K / Q6_K / Q8_0 matrices packed
    straight from the mapped file (ops/qgemm.py), each tensor's pages given back once packed."""
    from ops import qgemm
    from xinfer.models.layers import hold_packed

    def held(model) -> set[str]:
        blocks = ((name, qgemm.PackedWeight.from_gguf(kind, b, shape)) for name, kind, b, shape in
                  gguf.quantized_blocks(getattr(model, "keeps", None), drop=True) if qgemm.fits(kind, shape))
        names = hold_packed(model, blocks, model.remap)
        log.info("GGUF Q4_K / Q6_K / Q8_0 blocks held for %d weights, no float copy (8-bit activations, VNNI)",
                 len(model.held))
        return names
    return held


def bf16_held(path: str):
    """build_model's `held` for a checkpoint with bfloat16 matrices on the bfloat16 path: each Linear's,
    the head's and the embedding table's packed into bfloat16 panels (ops/qgemm.py Bf16Weight) straight
    from the mapped file, never widened to float32; the table's rows are looked up in them, exactly."""
    from ops.qgemm import Bf16Weight
    from xinfer.models.layers import hold_packed, holds

    def held(model) -> set[str]:
        want = holds(model, model.remap)
        blocks = ((name, Bf16Weight.of(t)) for name, t in hf.iter_safetensors(path, getattr(model, "keeps", None))
                  if t.dtype == torch.bfloat16 and t.dim() == 2 and want(name) and Bf16Weight.usable(t.shape))
        names = hold_packed(model, blocks, model.remap)
        log.info("bfloat16 weights held in panels for %d weights, not widened to float32", len(model.held))
        return names
    return held


def _random_init(model):
    g = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.fill_(0.0 if getattr(model, "norm_offset", 0.0) else 1.0)
        else:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.02)


def _progress(weights, path):
    t0 = last = time.monotonic()
    n = 0
    for item in weights:
        n += 1
        now = time.monotonic()
        if now - last > 2.0:
            log.info("loading %s: %d tensors, %.0fs", Path(path).name, n, now - t0)
            last = now
        yield item
    log.info("loaded %d tensors from %s in %.1fs", n, Path(path).name, time.monotonic() - t0)


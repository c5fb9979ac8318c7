"""Model sources: resolve a model name, read its config and tokenizer, build and load the model."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from xinfer.errors import ModelLoadError
from xinfer.loader import hf
from xinfer.loader.tokenizer import Tokenizer, load_hf_tokenizer

log = logging.getLogger("xinfer.loader")

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclass
class ModelInfo:
    kind: str  # "hf", "gguf" or "dummy"
    path: str
    config: dict
    generation_config: dict
    tokenizer: Tokenizer | None
    gguf: object = None

    @property
    def name(self) -> str:
        return Path(self.path).stem if self.kind == "gguf" else Path(self.path).name

    @property
    def eos_token_ids(self) -> list[int]:
        return self.tokenizer.eos_token_ids if self.tokenizer else _as_list(self.config.get("eos_token_id"))


def _as_list(v) -> list[int]:
    return [] if v is None else [int(x) for x in (v if isinstance(v, list) else [v])]


def load_model_info(model: str | None, load_format: str = "auto") -> ModelInfo:
    if load_format == "dummy":
        return _dummy_info(model)
    kind, path = hf.resolve_model(model)
    if kind == "gguf":
        from xinfer.loader.gguf import load_gguf

        g = load_gguf(path)
        eos = list(g.eog_token_ids)  # every end-of-generation token, e.g. Gemma's <end_of_turn>
        tok = Tokenizer(g.tokenizer, g.chat_template, g.bos_token_id, eos, add_bos=g.add_bos_token)
        return ModelInfo("gguf", path, g.config, {}, tok, gguf=g)
    cfg = hf.load_config(path)
    gen = hf.load_generation_config(path)
    eos = _as_list(gen.get("eos_token_id")) or _as_list(cfg.get("eos_token_id"))
    # A folder without tokenizer.json still serves token-id prompts (tiny test models, benchmarks).
    tok = load_hf_tokenizer(path, eos) if (Path(path) / "tokenizer.json").is_file() else None
    return ModelInfo("hf", path, cfg, gen, tok)


def _dummy_info(model: str | None) -> ModelInfo:
    """Random weights for benchmarks: `model` is a config.json, a folder holding one, or a shipped name."""
    candidates = [Path(model)] if model else []
    if model:
        candidates += [Path(model) / "config.json", CONFIGS_DIR / f"{model}.json"]
    for c in candidates:
        if c.is_file():
            cfg = hf.read_json(c)
            tok = None
            if (c.parent / "tokenizer.json").is_file():
                tok = load_hf_tokenizer(str(c.parent), _as_list(cfg.get("eos_token_id")))
            return ModelInfo("dummy", str(c), cfg, {}, tok)
    shipped = sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))
    raise ModelLoadError(f"--load-format dummy needs a config: a config.json path, a folder with one, "
                         f"or one of the shipped shapes {shipped}; got {model!r}")


def build_model(info: ModelInfo, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from xinfer.models import model_class

    cls = model_class(info.config)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(info.config)
    finally:
        torch.set_default_dtype(prev)
    if info.kind == "dummy":
        _random_init(model)
    else:
        weights = info.gguf.tensors() if info.kind == "gguf" else hf.iter_safetensors(info.path)
        try:
            model.load_weights(_progress(weights, info.path))
        except (KeyError, ValueError) as e:
            raise ModelLoadError(f"weights of {info.path} do not fit {cls.__name__}: {e}") from None
    return model.eval()


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


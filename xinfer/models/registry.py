"""HF architecture name -> model class."""
from xinfer.errors import ModelLoadError

MODELS: dict[str, type] = {}


def register(arch: str, cls: type) -> None:
    MODELS[arch] = cls


def model_class(cfg: dict) -> type:
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in MODELS:
            return MODELS[a]
    raise ModelLoadError(f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                         f"supported: {', '.join(sorted(MODELS))}")

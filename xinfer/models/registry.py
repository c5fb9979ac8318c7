"""HF architecture name -> model class: the causal LMs the engine serves (MODELS), and the
encoders --embedding-model serves (ENCODERS, xinfer/embedding_model.py)."""
from xinfer.errors import ModelLoadError

MODELS: dict[str, type] = {}
ENCODERS: dict[str, type] = {}


def register(arch: str, cls: type) -> None:
    MODELS[arch] = cls


def register_encoder(arch: str, cls: type) -> None:
    ENCODERS[arch] = cls


def model_class(cfg: dict, table: dict[str, type] = MODELS) -> type:
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in table:
            return table[a]
    raise ModelLoadError(f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                         f"supported: {', '.join(sorted(table))}")

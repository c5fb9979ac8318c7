"""xinfer: an LLM inference and serving engine.

The names below load on first use, so that `import xinfer.<module>` costs only that module:
the API, detokenizer and parser processes never import torch.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "xinfer.engine", "RequestOutput": "xinfer.engine", "Delta": "xinfer.engine",
    "EmbeddingModel": "xinfer.embedding_model", "EngineConfig": "xinfer.config", "SamplingParams": "xinfer.sampling_params",
    "XinferError": "xinfer.errors", "ModelLoadError": "xinfer.errors", "InvalidRequestError": "xinfer.errors",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'xinfer' has no attribute {name!r}")

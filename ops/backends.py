"""The attention backends by name: `get_backend` picks one for a device (the registry sits apart from
ops/attention.py so that the flashinfer backend, which builds on attention.py's classes, imports
nothing that imports it)."""
from __future__ import annotations

import torch

from ops.attention import AttentionBackend, TorchBackend, TritonBackend


def _flashinfer_backend():
    from ops.flashinfer_attention import FlashInferBackend  # imports flashinfer only when chosen
    return FlashInferBackend()


BACKENDS = {"torch": TorchBackend, "triton": TritonBackend, "flashinfer": _flashinfer_backend}


def auto_backend_name(device_type: str, has_flashinfer: bool, has_triton: bool) -> str:
    """On CUDA: flashinfer if installed, else Triton if installed, else torch. Elsewhere: torch."""
    if device_type != "cuda":
        return "torch"
    return "flashinfer" if has_flashinfer else "triton" if has_triton else "torch"


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """'auto' picks the fastest backend installed for the device (see auto_backend_name)."""
    if name == "auto":
        from importlib.util import find_spec
        name = auto_backend_name(device.type, find_spec("flashinfer") is not None, find_spec("triton") is not None)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(BACKENDS)} or 'auto'")
    return BACKENDS[name]()

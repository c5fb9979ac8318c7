import os

# Triton kernels run on the CPU through the interpreter; it must be chosen before triton loads.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, os.cpu_count() or 1))


def has_triton() -> bool:
    try:
        import triton  # noqa: F401
        return True
    except ImportError:
        return False


BACKENDS = ["torch"] + (["triton"] if has_triton() else [])


@pytest.fixture(scope="session")
def smollm_path():
    from xinfer.loader.hf import bundled_model_path
    return bundled_model_path()


@pytest.fixture(scope="session")
def smollm_hf(smollm_path):
    """transformers' own load of the bundled GGUF: the oracle for the real-model tests."""
    from transformers import AutoModelForCausalLM
    d, f = os.path.split(smollm_path)
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()

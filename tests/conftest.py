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


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    """A tiny random Llama saved by transformers (config, safetensors, generation config)."""
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         eos_token_id=1)
    path = tmp_path_factory.mktemp("tiny_llama")
    tf.LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)

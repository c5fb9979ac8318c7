"""Bad input gets a clear error naming the problem, and the engine keeps working."""
import json
import shutil
import subprocess
import sys

import pytest

from xinfer import Engine, EngineConfig, InvalidRequestError, ModelLoadError, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    return Engine(EngineConfig(model=tiny_llama_path, num_kv_blocks=64, max_model_len=64))


def test_missing_folder():
    with pytest.raises(ModelLoadError, match="not found.*/no/such/model"):
        Engine(EngineConfig(model="/no/such/model"))


def test_missing_hf_cache_id(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match="models--acme--nothing"):
        Engine(EngineConfig(model="acme/nothing"))


def test_hf_cache_id_resolves(tiny_llama_path, tmp_path, monkeypatch):
    snap = tmp_path / "models--acme--tiny" / "snapshots" / "abc123"
    shutil.copytree(tiny_llama_path, snap)
    (tmp_path / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    e = Engine(EngineConfig(model="acme/tiny", num_kv_blocks=16))
    assert e.info.name == "acme/tiny"  # served under its id, not the snapshot's hash
    assert len(e.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3


def test_corrupt_safetensors_header(tiny_llama_path, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama_path, bad)
    f = bad / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:40] = b"{not json at all" + b" " * 16
    f.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="corrupt safetensors file .*model.safetensors"):
        Engine(EngineConfig(model=str(bad), num_kv_blocks=16))


def test_truncated_gguf(smollm_path, tmp_path):
    f = tmp_path / "cut.gguf"
    with open(smollm_path, "rb") as src:
        f.write_bytes(src.read(3_000_000))
    with pytest.raises(ModelLoadError, match="truncated"):
        Engine(EngineConfig(model=str(f), num_kv_blocks=16))


def test_unknown_architecture(tiny_llama_path, tmp_path):
    bad = tmp_path / "alien"
    shutil.copytree(tiny_llama_path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["AlienForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="AlienForCausalLM.*supported: .*LlamaForCausalLM"):
        Engine(EngineConfig(model=str(bad), num_kv_blocks=16))


@pytest.mark.parametrize("prompt, params, match", [
    ([1] * 60, SamplingParams(max_tokens=10), "exceeds the model.s context length"),
    ([1] * 70, SamplingParams(max_tokens=None), "exceeds the model.s context length"),
    ([1, 2], SamplingParams(max_tokens=-1), "max_tokens must be >= 0"),
    ([1, 2], SamplingParams(top_p=1.5), "top_p must be in"),
    ([1, 2], SamplingParams(temperature=-0.5), "temperature must be in"),
    ([1, 999], SamplingParams(), "unknown token id 999"),
    ([1, 2], SamplingParams(stop_token_ids=[5000]), "token id 5000 is out of range"),
    ([1, 2], SamplingParams(logit_bias={3: 500.0}), "logit_bias"),
    ([], SamplingParams(), "prompt is empty"),
])
def test_bad_requests(engine, prompt, params, match):
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request(prompt, params)
    # the engine still serves the next valid request
    out = engine.generate([[3, 4, 5]], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    assert len(out.token_ids) == 2


def test_cli_names_the_problem():
    r = subprocess.run([sys.executable, "-m", "xinfer.cli", "generate", "--m", "/no/such/model"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "error: model '/no/such/model' not found" in r.stderr
    assert "Traceback" not in r.stderr


def test_quantization_flag_names_the_problem(tiny_llama_path):
    with pytest.raises(ValueError, match="must be one of"):
        EngineConfig(quantization="int3")
    r = subprocess.run([sys.executable, "-m", "xinfer.cli", "generate", "--m", tiny_llama_path, "--quantization", "gguf"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "error: --quantization gguf: the model has no weights the block kernels read" in r.stderr
    assert "Traceback" not in r.stderr

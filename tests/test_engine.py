"""Engine API behaviour on a tiny model: sampling controls, streaming shape, dummy weights."""
import json

import pytest
import torch

from xinfer import Engine, EngineConfig, SamplingParams
from xinfer.loader import load_model_info
from xinfer.models import model_class


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    return Engine(EngineConfig(model=tiny_llama_path, num_kv_blocks=64))


def test_logit_bias_and_min_tokens(engine):
    # A +100 bias on EOS (id 1) ends every request at once...
    out = engine.generate([[5, 6]], SamplingParams(max_tokens=10, logit_bias={1: 100.0}))[0]
    assert out.token_ids == [1] and out.finish_reason == "stop"
    # ...unless min_tokens holds EOS back.
    out = engine.generate([[5, 6]], SamplingParams(max_tokens=10, min_tokens=4, logit_bias={1: 100.0}))[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == 1 and 1 not in out.token_ids[:4]


def test_max_tokens_zero_and_n(engine):
    assert engine.generate([[5, 6]], SamplingParams(max_tokens=0))[0].token_ids == []
    outs = engine.generate([[5, 6, 7]], SamplingParams(n=4, max_tokens=5, temperature=1.0, seed=3,
                                                        ignore_eos=True))
    assert len(outs) == 4 and all(len(o.token_ids) == 5 for o in outs)


def test_stream_has_one_finish_per_sequence(engine):
    finishes = {}
    toks = {}
    for d in engine.stream([[3, 4], [9, 9, 9]], SamplingParams(max_tokens=6, ignore_eos=True)):
        toks.setdefault(d.seq_id, []).extend(d.token_ids)
        if d.finish_reason:
            finishes[d.seq_id] = finishes.get(d.seq_id, 0) + 1
    assert list(finishes.values()) == [1, 1]
    assert all(len(t) == 6 for t in toks.values())


def test_timings_and_outputs(engine):
    out = engine.generate([[3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True, logprobs=2))[0]
    assert out.prompt_token_ids == [3, 4, 5]
    assert out.queued_time <= out.first_token_time <= out.finished_time
    assert len(out.logprobs) == 3 and all(len(alts) == 2 for _, alts in out.logprobs)


def test_finished_requests_leave_only_their_cached_count(engine):
    """A server runs forever: once a request ends, the core keeps its cached-token count, not its
    Sequence (tokens, logprobs, images), so memory does not grow with the requests served."""
    import gc
    import weakref
    params = SamplingParams(max_tokens=4, logprobs=2)
    outs, refs = [], []
    for i in (8, 9):
        seq = engine._add([5, 6, 7] * 20 + [i], params)[0]
        refs.append(weakref.ref(seq))
        while engine.has_unfinished():
            engine.step()
        outs.append(engine._output(seq, ""))
        del seq
    gc.collect()
    assert [r() for r in refs] == [None, None]
    assert outs[1].num_cached_tokens > 0
    assert [engine.get_num_cached_tokens_for_seq(o.seq_id) for o in outs] == [o.num_cached_tokens for o in outs]


def test_dummy_weights_from_config(tiny_llama_path, tmp_path):
    cfg = json.loads(open(f"{tiny_llama_path}/config.json").read())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    e = Engine(EngineConfig(model=str(tmp_path / "config.json"), load_format="dummy", num_kv_blocks=16))
    assert len(e.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4


@pytest.mark.parametrize("name", ["Qwen3-0.6B", "Llama-3.2-1B"])
def test_shipped_dummy_configs_build(name):
    info = load_model_info(name, "dummy")
    with torch.device("meta"):
        model = model_class(info.config)(dict(info.config, _max_positions=64))
    n = sum(p.numel() for p in model.parameters())
    assert {"Qwen3-0.6B": 0.59e9, "Llama-3.2-1B": 1.23e9}[name] == pytest.approx(n, rel=0.03)


def test_bfloat16_runs(tiny_llama_path):
    e = Engine(EngineConfig(model=tiny_llama_path, num_kv_blocks=16, dtype="bfloat16"))
    assert len(e.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4


@pytest.mark.parametrize("kv", ["auto", "fp8", "turbo8"])
def test_prefix_hit_inside_a_block_gives_the_same_tokens(tiny_llama_path, kv):
    """The shared tokens past a prompt's last whole cached block are copied into its own block, scales
    and all: its tokens and logprobs are those of a cache without reuse."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    first = [(7 * i + 3) % 120 + 2 for i in range(40)]
    second = first[:21] + [11, 12, 13, 14]
    outs = []
    for reuse in (True, False):
        e = Engine(EngineConfig(model=tiny_llama_path, num_kv_blocks=64, kvcache_dtype=kv,
                                enable_prefix_cache=reuse))
        e.generate([first], params)
        outs.append(e.generate([second], params)[0])
        e.blocks.check_integrity()
        e.close()
    got, want = outs
    assert got.num_cached_tokens == 21 and want.num_cached_tokens == 0
    assert got.token_ids == want.token_ids
    assert [lp for lp, _ in got.logprobs] == pytest.approx([lp for lp, _ in want.logprobs], abs=1e-4)

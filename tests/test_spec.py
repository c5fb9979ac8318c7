"""Speculative decoding: lossless (greedy output identical, sampled output from the target's
distribution), with KV rollback, preemption, prefix caching, recovery and stats."""
import os
import signal

import pytest
import torch

from ops import cpu_kernels
from ops.sampling import SamplingBatch
from ops.speculative import verify
from xinfer import Engine, EngineConfig, SamplingParams
from xinfer.errors import ModelLoadError
from xinfer.spec import ngram_propose

PROMPTS = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [9, 8, 7], [20] * 30, [1, 2],
           [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}


def tiny(path, **kw):
    return Engine(EngineConfig(model=path, num_kv_blocks=kw.pop("num_kv_blocks", 96), block_size=4,
                               speculative_disable_by_batch_size=0, **kw))


@pytest.fixture(scope="module")
def reference(tiny_llama_path):
    return [o.token_ids for o in tiny(tiny_llama_path).generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory):
    """A second tiny random Llama with the target's vocabulary: a draft that is often wrong."""
    import transformers as tf
    torch.manual_seed(1)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, eos_token_id=1)
    path = tmp_path_factory.mktemp("tiny_draft")
    tf.LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def test_ngram_propose():
    assert ngram_propose([1, 2, 3, 4, 9, 1, 2, 3], 3, 2, 4) == [4, 9, 1]
    assert ngram_propose([1, 2, 3, 4, 9, 1, 2, 3], 1, 2, 4) == [4]
    assert ngram_propose([1, 2, 3, 7, 2, 3, 8, 2, 3], 2, 2, 2) == [8, 2]  # the most recent match
    assert ngram_propose([5, 1, 2, 6, 1, 2], 4, 3, 4) == []  # no 3-gram repeats
    assert ngram_propose([4, 4], 3, 1, 3) == [4]


def _batch(temps, **kw):
    return SamplingBatch(torch.tensor(temps), None, None, None, None, None, None, None, None, None, None,
                         kw.pop("seeds", []), all(t == 0 for t in temps), None, **kw)


def _chi2(counts, probs, n):
    exp = probs * n
    keep = exp > 0
    assert counts[~keep].sum() == 0  # nothing outside the target's support
    return float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("with_q", [False, True])
def test_verify_follows_the_target_distribution(with_q):
    """Every emitted token, at every position, is distributed as the target's row there."""
    torch.manual_seed(0)
    V, k, n = 6, 2, 4000
    p = torch.softmax(torch.randn(k + 1, V) * 1.5, -1)
    q = torch.softmax(torch.randn(k, V) * 1.5, -1)
    drafts, qs = [], []
    for _ in range(n):
        if with_q:
            drafts.append(torch.multinomial(q, 1)[:, 0].tolist())
            qs.append(q)
        else:
            drafts.append([0, 1])  # fixed drafts: accepted with probability p(d)
            qs.append(None)
    logits = p.log().repeat(n, 1)
    toks, _ = verify(logits, _batch([1.0] * (n * (k + 1))), drafts, qs)
    first = torch.bincount(torch.tensor([t[0] for t in toks]), minlength=V)
    stat, df = _chi2(first, p[0], n)
    assert stat < CHI2_001[df]
    # the second token, given the first draft was accepted (the rows are independent of the prefix here)
    second = [t[1] for t, d in zip(toks, drafts) if len(t) > 1 and t[0] == d[0]]
    stat, df = _chi2(torch.bincount(torch.tensor(second), minlength=V), p[1], len(second))
    assert stat < CHI2_001[df]
    assert all(1 <= len(t) <= k + 1 for t in toks)


def test_verify_greedy_accepts_while_the_argmax_matches():
    logits = torch.tensor([[0., 5, 1], [9., 0, 1], [0., 0, 3], [1., 0, 0], [0., 2, 0]])
    toks, _ = verify(logits, _batch([0.0] * 5), [[1, 0], [2]], [None, None])
    assert toks == [[1, 0, 2], [0]]  # all accepted, then the bonus; the second rejected at once


@pytest.mark.parametrize("method", ["ngram", "draft-self", "draft-other"])
def test_greedy_output_is_unchanged(tiny_llama_path, draft_path, reference, method):
    draft = {"draft-self": tiny_llama_path, "draft-other": draft_path}.get(method)
    e = tiny(tiny_llama_path, num_speculative_tokens=3, draft_model=draft)
    assert [o.token_ids for o in e.generate(PROMPTS, GREEDY)] == reference
    s = e.scheduler
    assert s.num_spec_steps > 0 and s.num_accepted_tokens <= s.num_draft_tokens
    if method == "draft-self":  # the same model drafts: every draft is the target's own choice
        assert s.num_accepted_tokens == s.num_draft_tokens
    elif method == "ngram":
        assert s.num_accepted_tokens > 0
    e.blocks.check_integrity()


def test_joiners_preemption_and_prefix_cache(tiny_llama_path, reference):
    """Requests joining mid-run, a cache small enough to preempt, and a repeat that hits the
    prefix cache: the same greedy tokens, and every block accounted for."""
    e = tiny(tiny_llama_path, num_speculative_tokens=4, num_kv_blocks=30)
    ids, toks = [], {}
    for i, p in enumerate(PROMPTS + PROMPTS[:2]):
        ids += e.add_request(p, GREEDY)
        for _ in range(3):
            for d in e.step():
                toks.setdefault(d.seq_id, []).extend(d.token_ids)
    while e.has_unfinished():
        for d in e.step():
            toks.setdefault(d.seq_id, []).extend(d.token_ids)
    assert [toks[i] for i in ids] == reference + reference[:2]
    assert e.scheduler.num_preemptions > 0 and e.scheduler.num_accepted_tokens > 0
    assert e.core.num_cached_prompt_tokens > 0
    e.blocks.check_integrity()


def test_max_tokens_stop_tokens_and_logprobs(tiny_llama_path):
    base, fast = tiny(tiny_llama_path), tiny(tiny_llama_path, num_speculative_tokens=4)
    for params in (SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[20]),
                   SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)):
        a, b = base.generate(PROMPTS, params), fast.generate(PROMPTS, params)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
        if params.logprobs:
            for x, y in zip(a, b):
                assert len(y.logprobs) == len(y.token_ids)
                for (lx, ax), (ly, ay) in zip(x.logprobs, y.logprobs):
                    assert abs(lx - ly) < 1e-4 and [t for t, _ in ax] == [t for t, _ in ay]
    assert fast.scheduler.num_accepted_tokens > 0


def test_sampling_matches_the_target_distribution(tiny_llama_path, draft_path):
    """Seeded requests sampled with a draft model that is often wrong: the joint distribution of the
    speculated tokens 2 and 3 is the one sampled without speculation (a two-sample chi-square)."""
    prompt, n = [7, 8, 9, 10], 400
    counts = []
    for kw in ({}, {"num_speculative_tokens": 2, "draft_model": draft_path}):
        e = tiny(tiny_llama_path, **kw)
        outs = e.generate([prompt] * n, [SamplingParams(temperature=1.0, top_k=3, seed=s, max_tokens=3,
                                                        ignore_eos=True) for s in range(n)])
        pairs = [tuple(o.token_ids[1:3]) for o in outs]
        counts.append({c: pairs.count(c) for c in set(pairs)})
        if kw:
            assert e.scheduler.num_draft_tokens > e.scheduler.num_accepted_tokens > 0
            again = e.generate([prompt] * 3, [SamplingParams(temperature=1.0, top_k=3, seed=s, max_tokens=3,
                                                             ignore_eos=True) for s in range(3)])
            assert [o.token_ids for o in again] == [o.token_ids for o in outs[:3]]  # seeded: reproducible
    cats = set(counts[0]) | set(counts[1])
    stat = sum((counts[0].get(c, 0) - counts[1].get(c, 0)) ** 2 / (counts[0].get(c, 0) + counts[1].get(c, 0))
               for c in cats)
    assert stat < CHI2_001[min(len(cats) - 1, 8)] * (1 if len(cats) <= 9 else 1.5)


def test_killed_worker_recovers_with_speculation(tiny_llama_path, reference):
    e = Engine(EngineConfig(model=tiny_llama_path, num_kv_blocks=96, block_size=4, num_speculative_tokens=3,
                            speculative_disable_by_batch_size=0), worker="process", log_level="warning")
    try:
        ids = [e.add_request(p, GREEDY)[0] for p in PROMPTS]
        toks, steps = {i: [] for i in ids}, 0
        while e.has_unfinished():
            if steps == 5:
                os.kill(e.runner.proc.pid, signal.SIGKILL)
            for d in e.step():
                toks[d.seq_id].extend(d.token_ids)
            steps += 1
        assert e.runner.restarts == 1
        assert [toks[i] for i in ids] == reference
        st = e.core.stats()
        assert st.spec_draft_tokens >= st.spec_accepted_tokens > 0
    finally:
        e.close()


def test_bad_settings_are_clear_errors(tiny_llama_path, tmp_path, smollm_path):
    with pytest.raises(ModelLoadError, match="no MTP layers"):
        tiny(tiny_llama_path, speculative_method="mtp")
    with pytest.raises(ModelLoadError, match="needs --draft-model"):
        tiny(tiny_llama_path, speculative_method="draft")
    with pytest.raises(ModelLoadError, match="tokenizer is not the target's|vocab_size"):
        tiny(tiny_llama_path, draft_model=smollm_path)
    import json
    import shutil
    d = tmp_path / "dflash"
    shutil.copytree(tiny_llama_path, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["DFlash2DraftModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="DFlash"):
        tiny(tiny_llama_path, draft_model=str(d))
    with pytest.raises(ValueError, match="--num-speculative-tokens"):
        EngineConfig(num_speculative_tokens=-1)


@pytest.mark.slow
def test_bundled_model_copy_and_self_draft(smollm_path):
    """The real model asked to repeat a text: n-gram drafts are mostly accepted; with itself as the
    draft model every draft is (same weights, same greedy choice) and the output is unchanged."""
    text = ("Repeat after me, word for word: The committee met on Tuesday to review the budget for the new "
            "library. After a long discussion, they agreed to fund the project in two phases.")
    params = SamplingParams(temperature=0, max_tokens=40)
    base = Engine(EngineConfig(cpu_matmul="float32"))
    ref = base.generate([text], params)[0].token_ids
    for kw in ({"num_speculative_tokens": 4}, {"num_speculative_tokens": 3, "draft_model": smollm_path}):
        e = Engine(EngineConfig(cpu_matmul="float32", **kw))
        assert e.generate([text], params)[0].token_ids == ref
        s = e.scheduler
        if "draft_model" in kw:
            assert s.num_accepted_tokens >= 0.9 * s.num_draft_tokens > 0
        else:
            assert s.num_accepted_tokens > 0


@pytest.mark.slow
@pytest.mark.skipif(not cpu_kernels.has_bf16(), reason="no AVX512_BF16 block kernels in this build (the bf16 "
                    "build test in test_cpu_kernels.py reruns this where the CPU has them)")
def test_bf16_path_stays_lossless(smollm_path):
    """The fast path (bfloat16 dot products in the block kernels): a sequence's rows give the same
    numbers alone or with its drafts beside them, so greedy output is the same with n-gram drafts;
    also for three sequences with up to 7 drafts each (verify batches past 16 rows)."""
    text = "Repeat after me: one two three four five six seven eight nine ten, one two three four five"
    params = SamplingParams(temperature=0, max_tokens=32)
    base = Engine(EngineConfig(cpu_matmul="bfloat16"))
    fast = Engine(EngineConfig(cpu_matmul="bfloat16", num_speculative_tokens=4))
    assert fast.generate([text], params)[0].token_ids == base.generate([text], params)[0].token_ids
    assert fast.scheduler.num_accepted_tokens > 0
    texts = [text, text.replace("one", "uno"), "Count: a b c d e f g h, a b c d e f g h, a b c d"]
    wide = Engine(EngineConfig(cpu_matmul="bfloat16", num_speculative_tokens=7))
    assert ([o.token_ids for o in wide.generate(texts, params)] == [o.token_ids for o in base.generate(texts, params)])
    assert wide.scheduler.num_accepted_tokens > 0

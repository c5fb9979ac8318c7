"""The batched sampler against plain reference computations."""
import torch

from ops.sampling import SamplingBatch, apply_penalties, sample

V = 12


def batch(B, **kw):
    base = dict(temperature=torch.ones(B), top_k=None, top_p=None, min_p=None, repetition_penalty=None,
                presence_penalty=None, frequency_penalty=None, output_ids=None, prompt_ids=None, bias=None,
                banned=None, seeds=[], all_greedy=False, num_logprobs=None)
    base.update(kw)
    return SamplingBatch(**base)


def test_penalties_match_reference():
    torch.manual_seed(0)
    logits = torch.randn(2, V)
    out_ids = [[3, 3, 5], [7]]
    prompt_ids = [[1, 2], [3]]
    rep, pres, freq = [1.3, 0.8], [0.5, -0.2], [0.25, 1.0]
    pad = lambda rows: torch.tensor([r + [V] * (3 - len(r)) for r in rows])  # noqa: E731
    b = batch(2, repetition_penalty=torch.tensor(rep), presence_penalty=torch.tensor(pres),
              frequency_penalty=torch.tensor(freq), output_ids=pad(out_ids), prompt_ids=pad(prompt_ids),
              bias=(torch.tensor([0]), torch.tensor([4]), torch.tensor([2.5])))
    got = apply_penalties(logits.clone(), b)
    want = logits.clone()
    want[0, 4] += 2.5
    for r in range(2):
        for t in set(out_ids[r]) | set(prompt_ids[r]):
            want[r, t] = want[r, t] / rep[r] if want[r, t] > 0 else want[r, t] * rep[r]
        for t in set(out_ids[r]):
            want[r, t] -= freq[r] * out_ids[r].count(t) + pres[r]
    assert torch.allclose(got, want, atol=1e-6)


def test_greedy_and_banned():
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 1.0, 0.0]])
    b = batch(2, temperature=torch.zeros(2), all_greedy=True, banned=(torch.tensor([0]), torch.tensor([1])))
    toks, _ = sample(logits, b)
    assert toks.tolist() == [2, 0]


def test_distribution_follows_softmax():
    torch.manual_seed(1)
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0]).repeat(20000, 1)
    toks, _ = sample(logits, batch(20000, temperature=torch.full((20000,), 0.7)))
    freq = torch.bincount(toks, minlength=4).float() / 20000
    assert torch.allclose(freq, torch.softmax(logits[0] / 0.7, -1), atol=0.015)


def test_top_k_top_p_min_p_support():
    torch.manual_seed(2)
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0]).repeat(3000, 1)
    probs = torch.softmax(logits[0], -1)
    k = batch(3000, top_k=torch.full((3000,), 2))
    assert set(sample(logits, k)[0].tolist()) == {0, 1}
    # nucleus: the smallest prefix of the sorted tokens whose mass reaches top_p
    p = 0.8
    n_keep = int((torch.cumsum(probs, 0) - probs < p).sum())
    got = set(sample(logits, batch(3000, top_p=torch.full((3000,), p)))[0].tolist())
    assert got == set(range(n_keep))
    m = batch(3000, min_p=torch.full((3000,), 0.3))
    assert set(sample(logits, m)[0].tolist()) == {i for i in range(6) if probs[i] >= 0.3 * probs[0]}


def test_seeded_rows_ignore_neighbours():
    logits = torch.randn(4, 50)
    a, _ = sample(logits, batch(4, seeds=[(2, 99)]))
    other = torch.randn(4, 50)
    other[2] = logits[2]
    b, _ = sample(other, batch(4, seeds=[(2, 99)]))
    assert a[2] == b[2]


def test_seeded_uniforms_are_splitmix64_and_uniform():
    """The vectorised draw equals splitmix64 computed on Python integers, and its values spread
    evenly over (0, 1)."""
    from ops.sampling import seeded_uniforms
    M = (1 << 64) - 1

    def ref(seed, j):
        z = (seed + j * 0x9E3779B97F4A7C15) & M
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
        return (((z ^ (z >> 31)) >> 41) * 2 + 1) / (1 << 24)
    seeds = [0, 1, 99, (1 << 62) + 12345, (1 << 63) - 1]
    got = seeded_uniforms(torch.tensor(seeds), 3)
    assert got.tolist() == [[ref(s, j) for j in (1, 2, 3)] for s in seeds]
    u = seeded_uniforms(torch.arange(20000), 1)[:, 0]
    assert 0 < u.min() and u.max() < 1
    assert torch.histc(u, bins=10, min=0, max=1).sub(2000).abs().max() < 200


def test_logprobs_are_raw_model_logprobs():
    logits = torch.randn(2, V)
    toks, (chosen, ids, vals) = sample(logits, batch(2, temperature=torch.zeros(2), all_greedy=True,
                                                     num_logprobs=3, bias=(torch.tensor([1]),
                                                                           torch.tensor([0]),
                                                                           torch.tensor([50.0]))))
    ref = torch.log_softmax(logits, -1)
    assert toks[1] == 0  # the bias steers sampling...
    assert torch.allclose(chosen, ref.gather(1, toks[:, None])[:, 0])  # ...but logprobs are the model's
    assert torch.allclose(vals, ref.topk(3, -1).values)


def test_inverse_cdf_draw_never_picks_a_zero_probability_token():
    """The ends of U(0, 1) land on the first and last tokens with mass, never on one without."""
    from ops.sampling import draw
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 3)
    u = torch.tensor([[0.0], [0.5 - 1e-7], [1.0 - 1e-7]])
    assert draw(probs, u).tolist() == [1, 1, 3]


def test_candidates_give_the_full_sort_nucleus():
    """top-k / top-p from each row's largest CANDIDATES probabilities equal the full sort's, a row
    whose nucleus reaches past them (a flat one) included; a row with neither keeps every token."""
    from ops import sampling as S
    V = 5000
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, V, generator=g) * torch.tensor([[4.0], [4.0], [4.0], [0.01], [4.0], [2.0]])
    probs = torch.softmax(logits, dim=-1)
    top_k = torch.tensor([V, 40, 300, V, V, 7])
    top_p = torch.tensor([0.9, 1.0, 0.8, 0.95, 1.0, 0.5])
    for k, p in ((top_k, top_p), (None, top_p), (top_k, None)):
        b = batch(6, top_k=k, top_p=p, top_k_max=300)
        want = S._nucleus(probs, k, p)
        got = S._filter(probs.clone(), b)
        assert torch.allclose(got, want, atol=1e-7), (k is None, p is None)
    assert torch.equal(S._filter(probs.clone(), batch(6, top_k=top_k, top_p=top_p, top_k_max=300))[4], probs[4])


def test_greedy_rows_beside_sampled_ones_and_the_hosts_flag():
    """A temperature-0 row in a sampled batch takes its argmax; the batch built from requests says on
    the host whether it has one (none: the sampler skips that argmax, whose rows it would not use)."""
    from xinfer.sampling_params import SamplingParams
    from xinfer.workers.batch import WorkerSeq, sampling_batch
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    b = batch(3, temperature=torch.tensor([1.0, 0.0, 1.0]))
    assert sample(logits, b)[0][1] == logits[1].argmax()
    seqs = lambda *temps: [WorkerSeq([1, 2], 2, 2, [0], SamplingParams(temperature=t), None) for t in temps]  # noqa: E731
    assert sampling_batch(seqs(1.0, 0.0), V, [], "cpu").any_zero_temp
    assert not sampling_batch(seqs(1.0, 0.7), V, [], "cpu").any_zero_temp


def test_sampling_batch_bans_and_seeds_from_the_outputs_without_copying_them():
    """A bad word's last token is banned only once the outputs end with the rest of it (never from
    the prompt's tokens); min_tokens and a seed's position count the outputs."""
    from xinfer.sampling_params import SamplingParams
    from xinfer.workers.batch import WorkerSeq, sampling_batch
    p = SamplingParams(bad_words_ids=[[7, 8, 9], [5]], min_tokens=3, stop_token_ids=[4], ignore_eos=True)
    rows = [([7, 8], 2), ([1, 7, 8], 1), ([7, 8, 1], 1), ([7, 8], 1)]  # (tokens, prompt length)
    seqs = [WorkerSeq(tokens=t, num_prompt=n, num_computed=len(t), block_ids=[0], params=p, seed=11) for t, n in rows]
    b = sampling_batch(seqs, 32, [0], torch.device("cpu"))
    banned = sorted(zip(b.banned[0].tolist(), b.banned[1].tolist()))
    # row 0: no outputs; row 1: outputs [7, 8] end with the prefix; row 2: [8, 1]; row 3: [8], its 7 the prompt's
    assert banned == [(0, 4), (0, 5), (1, 4), (1, 5), (1, 9), (2, 4), (2, 5), (3, 4), (3, 5)]
    assert b.seeds == [(i, 11 * 1_000_003 + len(t) - n) for i, (t, n) in enumerate(rows)]

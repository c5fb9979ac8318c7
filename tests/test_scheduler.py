"""Block manager and scheduler invariants, without a model."""
from xinfer.config import EngineConfig
from xinfer.ipc.step import StepResult, pack_ids
from xinfer.kv_cache import MAX_CHILDREN, BlockManager, block_hash
from xinfer.sampling_params import SamplingParams
from xinfer.scheduler import Scheduler, Sequence


def seq(i, n_prompt, max_tokens=4, **kw):
    return Sequence(i, f"r{i}", list(range(100 + i, 100 + i + n_prompt)), SamplingParams(**kw), None, max_tokens)


def make(num_blocks=16, bs=4, **kw):
    cfg = EngineConfig(block_size=bs, device="cpu", **kw)
    return Scheduler(cfg, BlockManager(num_blocks, bs, cfg.enable_prefix_cache), 1000, [0])


def run_step(s, token=7):
    plan = s.schedule()
    done = [x.seq_id for x in plan.scheduled if s.seqs[x.seq_id].num_computed + x.num_tokens
            == s.seqs[x.seq_id].num_tokens]
    s.update(StepResult(plan.step_id, done, pack_ids([token] * len(done))))
    return plan


def test_chunked_prefill_respects_budget_and_chunk():
    s = make(num_blocks=64, max_num_batched_tokens=10, prefill_chunk_size=6)
    s.add(seq(1, 20))
    s.add(seq(2, 3))
    plan = s.schedule()
    assert [(x.seq_id, x.num_tokens) for x in plan.scheduled] == [(1, 6), (2, 3)]
    assert sum(x.num_tokens for x in plan.scheduled) <= 10


def test_a_prompt_alone_takes_the_whole_budget_on_a_cpu():
    s = make(num_blocks=400, max_num_batched_tokens=1000)  # the chunk size left to auto: 512 on a CPU
    s.add(seq(1, 2000))
    assert [x.num_tokens for x in run_step(s).scheduled] == [1000]  # nothing beside it: the whole budget
    s.add(seq(2, 3))
    assert [(x.seq_id, x.num_tokens) for x in run_step(s).scheduled] == [(1, 512), (2, 3)]  # the cap again
    s = make(num_blocks=400, max_num_batched_tokens=1000, prefill_chunk_size=300)  # asked for: kept
    s.add(seq(1, 1500))
    assert [x.num_tokens for x in run_step(s).scheduled] == [300]
    assert EngineConfig(device="cuda").prefill_chunk_alone == 2048  # CUDA: unchanged


def test_prefix_cache_hit_and_last_block_recomputed():
    s = make()
    a = seq(1, 12)
    s.add(a)
    while a.status != "finished":
        run_step(s)
    b = Sequence(2, "r2", list(a.prompt_ids), SamplingParams(), None, 2)
    s.add(b)
    plan = s.schedule()
    # 12 tokens = 3 full blocks, all cached; the last token is recomputed for logits, in a copy of
    # the last block's first three slots
    assert b.num_cached_tokens == 11 and [x[2] for x in plan.kv_copies] == [3]
    assert plan.new_seqs[0].num_computed == 11 and plan.scheduled[0].num_tokens == 1


def test_prefix_cache_hit_inside_a_block_copies_its_slots():
    """A prompt that shares a cached block's first tokens (a system prompt ending mid-block) reuses
    them too: the plan has the worker copy those slots into the prompt's own block."""
    s = make()
    a = seq(1, 10)
    s.add(a)
    while a.status != "finished":
        run_step(s)
    b = Sequence(2, "r2", a.prompt_ids[:6] + [900, 901, 902], SamplingParams(), None, 2)
    s.add(b)
    plan = s.schedule()
    assert b.num_cached_tokens == 6 and plan.new_seqs[0].num_computed == 6
    src = s.bm.cached[block_hash(b.block_hashes[0], a.prompt_ids[4:8])]  # a's second block
    assert plan.kv_copies == [(src, b.block_ids[1], 2)]
    assert plan.scheduled[0].num_tokens == 3
    s.bm.check_integrity()


def test_cached_tokens_count_at_admission_not_at_a_failed_try():
    """A prompt whose first try at admission matched cached blocks but found no room, and whose
    blocks were reused before it got in, reports the hits it was admitted with."""
    s = make(num_blocks=6)
    a = seq(1, 8, max_tokens=1)
    s.add(a)
    while s.has_work():
        run_step(s)  # a's two blocks cached, free
    b = seq(2, 14, max_tokens=4)
    s.add(b)
    run_step(s)  # b holds 4 of the 6 blocks
    c = Sequence(3, "r3", a.prompt_ids + [900] * 9, SamplingParams(), None, 2)
    s.add(c)
    run_step(s)  # c matches a's blocks, needs 3 more: waits
    assert c.status == "waiting"
    while s.has_work():
        run_step(s)  # b's fifth block is a's second: c gets in with a's first only
    assert c.num_cached_tokens == 4 and c.status == "finished"
    s.bm.check_integrity()


def test_partial_matches_forget_reused_blocks_and_keep_the_newest():
    bm = BlockManager(40, 4)
    bm.register(0, 11, None, [1, 2, 3, 4])
    bm.register(1, 12, None, [1, 2, 9, 9])
    assert bm.match_partial(None, [1, 2, 9]) == (1, 3) and bm.match_partial(None, [1, 2, 3, 5]) == (0, 3)
    assert bm.match_partial(None, [7]) == (None, 0) and bm.match_partial(11, [1]) == (None, 0)
    assert bm.allocate(1) == [0]  # its data is overwritten: no longer a match
    assert bm.match_partial(None, [1, 2, 3]) == (1, 2)
    for b in range(2, 2 + MAX_CHILDREN + 3):
        bm.register(b, 100 + b, 12, [b, 0, 0, 0])
    assert bm.match_partial(12, [2]) == (None, 0)  # the oldest children dropped past the cap
    assert bm.match_partial(12, [b, 0]) == (b, 2) and bm.cached[102] == 2  # still a whole-block hit
    bm.check_integrity()
    bm.forget_cached()
    assert bm.match_partial(None, [1, 2]) == (None, 0) and not bm.children
    bm.check_integrity()


def test_lru_eviction_keeps_integrity():
    s = make(num_blocks=6)
    for i in range(8):
        q = seq(i, 9, max_tokens=2)
        s.add(q)
        while s.has_work():
            run_step(s)
        s.bm.check_integrity()
    assert s.bm.num_free == 6


def test_preemption_by_recompute():
    s = make(num_blocks=5, bs=4)
    a, b = seq(1, 7, max_tokens=8), seq(2, 7, max_tokens=8)
    s.add(a)
    s.add(b)
    steps = 0
    while s.has_work():
        run_step(s)
        s.bm.check_integrity()
        steps += 1
        assert steps < 200
    assert s.num_preemptions > 0
    assert len(a.output_ids) == 8 and len(b.output_ids) == 8
    assert s.bm.num_free == 5


def test_stop_conditions():
    s = make()
    a = seq(1, 3, max_tokens=10, min_tokens=2)
    s.add(a)
    run_step(s, token=0)  # EOS before min_tokens: ignored
    run_step(s, token=0)
    assert a.finish_reason == "stop" and len(a.output_ids) == 2
    b = seq(2, 3, max_tokens=10, stop_token_ids=[9])
    s.add(b)
    run_step(s, token=9)
    assert b.finish_reason == "stop"
    c = seq(3, 3, max_tokens=10, ignore_eos=True)
    s.add(c)
    run_step(s, token=0)
    assert c.status == "running"


def test_n_siblings_share_prompt_blocks():
    s = make(num_blocks=32)
    parent, kids = seq(1, 10, max_tokens=3), [seq(2, 10, max_tokens=3), seq(3, 10, max_tokens=3)]
    for k in kids:
        k.prompt_ids = list(parent.prompt_ids)
    s.add(parent, kids)
    run_step(s)  # parent computes its prompt and samples; siblings are released
    assert all(k.num_computed == 8 for k in kids)  # 2 full blocks shared, the tail recomputed
    shared = parent.block_ids[:2]
    assert all(k.block_ids[:2] == shared for k in kids)
    assert all(s.bm.ref[b] == 3 for b in shared)
    while s.has_work():
        run_step(s)
    assert s.bm.num_free == 32


def test_abort_frees_blocks():
    s = make()
    a = seq(1, 10)
    s.add(a)
    run_step(s)
    s.abort(1)
    assert a.finish_reason == "abort" and s.bm.num_free == 16
    plan = s.schedule()
    assert plan.dropped == [1]


def test_prefix_cache_max_tokens_caps_reusable_blocks():
    cfg = EngineConfig(block_size=4, device="cpu", prefix_cache_max_tokens=8)
    s = Scheduler(cfg, BlockManager(32, 4, True, cfg.prefix_cache_max_tokens), 1000, [0])
    for i in range(3):
        s.add(seq(i, 12, max_tokens=1))
        while s.has_work():
            run_step(s)
    assert s.bm.num_cached_blocks() <= 2  # 8 tokens / 4 per block
    s.bm.check_integrity()


def test_disabled_prefix_cache_never_hits():
    cfg = EngineConfig(block_size=4, device="cpu", enable_prefix_cache=False)
    s = Scheduler(cfg, BlockManager(32, 4, False), 1000, [0])
    a = seq(1, 12, max_tokens=1)
    s.add(a)
    while s.has_work():
        run_step(s)
    b = Sequence(2, "r2", list(a.prompt_ids), SamplingParams(), None, 1)
    s.add(b)
    s.schedule()
    assert b.num_cached_tokens == 0 and s.bm.num_cached_blocks() == 0

"""Overlap scheduling: the next step is planned and sent before the one in flight is read back
(EngineCore.step, Scheduler.schedule(ahead=True)), and the tokens are those of one step at a time."""
from xinfer import Engine, EngineConfig, SamplingParams
from xinfer.ipc.step import StepResult, pack_ids
from tests.test_scheduler import make, seq

PROMPTS = [[3, 4, 5, 6, 7, 8, 9], [9, 8, 7], [20] * 30, [1, 2], [5, 5, 6], [40, 41, 42, 43]]
G = {"temperature": 0}  # unseeded sampling draws from the global generator: its tokens depend on the steps taken
PARAMS = [SamplingParams(max_tokens=12, ignore_eos=True, **G), SamplingParams(max_tokens=3, ignore_eos=True, **G),
          SamplingParams(max_tokens=9, ignore_eos=True, **G),
          SamplingParams(max_tokens=10, min_tokens=4, logit_bias={1: 100.0}, **G),  # ends on EOS at 5: unforeseen
          SamplingParams(max_tokens=1, **G), SamplingParams(max_tokens=7, temperature=0.9, seed=5, ignore_eos=True)]


def _tokens(tiny_llama_path, **kw):
    e = Engine(EngineConfig(model=tiny_llama_path, block_size=4, **kw))
    events = []
    submit, collect = e.runner.submit, e.runner.collect

    def rec_submit(plan):
        events.append(("submit", plan.step_id))
        submit(plan)

    def rec_collect():
        r = collect()
        events.append(("collect", r.step_id))
        return r
    e.runner.submit, e.runner.collect = rec_submit, rec_collect
    outs = e.generate(PROMPTS, PARAMS)
    e.blocks.check_integrity()
    assert e.blocks.num_free == e.blocks.num_blocks  # nothing held by a finished request (cached ones are free)
    return [(o.token_ids, o.finish_reason) for o in outs], events, e


def test_overlap_gives_the_tokens_of_one_step_at_a_time(tiny_llama_path):
    want, events, _ = _tokens(tiny_llama_path, num_kv_blocks=64, disable_overlap_schedule=True)
    assert all(a == ("submit", i) and b == ("collect", i) for i, (a, b) in enumerate(zip(events[::2], events[1::2]), 1))
    got, events, e = _tokens(tiny_llama_path, num_kv_blocks=64)
    assert got == want
    assert want[3][1] == "stop" and len(want[3][0]) == 5 and want[4][1] == "length"
    # steady state: step N + 1 goes out before step N's result is read
    ahead = [i for i in range(1, len(events) - 1) if events[i][0] == "submit" and events[i + 1] == ("collect", events[i][1] - 1)]
    assert len(ahead) >= 8


def test_overlap_under_a_small_cache_preempts_only_in_step(tiny_llama_path):
    """12 blocks of 4 tokens for 6 requests: sequences wait or are preempted and recomputed; the
    tokens stay those of the engine without overlap."""
    want, _, _ = _tokens(tiny_llama_path, num_kv_blocks=12, disable_overlap_schedule=True)
    got, _, e = _tokens(tiny_llama_path, num_kv_blocks=12)
    assert got == want
    assert e.scheduler.num_preemptions > 0


def test_ahead_leaves_out_what_surely_ends_and_assumes_one_token():
    s = make(num_blocks=16, bs=4)
    a, b = seq(1, 3, max_tokens=1), seq(2, 4, max_tokens=5)
    s.add(a)
    s.add(b)
    first = s.schedule()
    assert s.can_schedule_ahead()
    ahead = s.schedule(ahead=True)
    # a samples its one token in the first step: it ends there; b computes the token it samples there
    assert [(x.seq_id, x.num_tokens) for x in ahead.scheduled] == [(2, 1)]
    assert ahead.scheduled[0].new_block_ids and len(b.block_ids) == 2  # position 4 needs a second block
    assert not s.can_schedule_ahead()  # one step ahead at most
    s.update(StepResult(first.step_id, [1, 2], pack_ids([7, 8])))
    assert a.status == "finished" and b.output_ids == [8] and b.num_computed == 4
    s.update(StepResult(ahead.step_id, [2], pack_ids([9])))
    assert b.output_ids == [8, 9] and b.num_computed == 5
    s.bm.check_integrity()

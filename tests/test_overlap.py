"""Overlap scheduling: the next step is planned and sent before the one in flight is read back
(EngineCore.step, Scheduler.schedule(ahead=True)), and the tokens are those of one step at a time."""
import pytest

from xinfer import Engine, EngineConfig, SamplingParams
from xinfer.ipc.shm_ring import RingClosed
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
    want, events, _ = _tokens(tiny_llama_path, num_kv_blocks=64, overlap_schedule="off")
    assert all(a == ("submit", i) and b == ("collect", i) for i, (a, b) in enumerate(zip(events[::2], events[1::2]), 1))
    got, events, e = _tokens(tiny_llama_path, num_kv_blocks=64, overlap_schedule="on")
    assert got == want
    assert want[3][1] == "stop" and len(want[3][0]) == 5 and want[4][1] == "length"
    # steady state: step N + 1 goes out before step N's result is read
    ahead = [i for i in range(1, len(events) - 1) if events[i][0] == "submit" and events[i + 1] == ("collect", events[i][1] - 1)]
    assert len(ahead) >= 8


def test_pipelined_steps_give_the_tokens_of_one_step_at_a_time(tiny_llama_path, monkeypatch):
    """Steps launched before the last one's tokens are read (xinfer/workers/pipeline.py, CUDA's
    default, forced here on the CPU): the input token of a sequence comes from the device. With
    logprobs, a repetition penalty (which reads the tokens: its steps wait) and a small cache
    (preemption, recompute), the tokens are those of one step at a time."""
    params = PARAMS[:-1] + [SamplingParams(max_tokens=7, temperature=0.9, seed=5, ignore_eos=True, logprobs=2)]
    runs = {}
    for pipelined in (False, True):
        monkeypatch.setenv("XINFER_CPU_PIPELINE", "1" if pipelined else "0")
        for blocks in (64, 12):
            for rep in (1.0, 1.3):
                ps = params[:1] + [SamplingParams(max_tokens=5, ignore_eos=True, repetition_penalty=rep, **G)] + params[2:]
                e = Engine(EngineConfig(model=tiny_llama_path, block_size=4, num_kv_blocks=blocks, overlap_schedule="on"))
                outs = e.generate(PROMPTS, ps)
                runs[pipelined, blocks, rep] = ([(o.token_ids, o.finish_reason) for o in outs],
                                                [[c[0] for c in o.logprobs] for o in outs if o.logprobs])
                assert (e.runner.early_launches > 4) == pipelined, e.runner.early_launches
                e.blocks.check_integrity()
                e.close()
    for key, want in runs.items():
        got = runs[True, *key[1:]]
        assert got[0] == want[0]
        assert all(abs(a - b) < 1e-5 for x, y in zip(got[1], want[1]) for a, b in zip(x, y))
    # the worker in its own process (serving's shape) launches ahead from the plans in its ring
    e = Engine(EngineConfig(model=tiny_llama_path, block_size=4, num_kv_blocks=64, overlap_schedule="on"),
               worker="process", log_level="warning")
    try:
        ps = params[:1] + [SamplingParams(max_tokens=5, ignore_eos=True, **G)] + params[2:]
        assert [(o.token_ids, o.finish_reason) for o in e.generate(PROMPTS, ps)] == runs[False, 64, 1.0][0]
    finally:
        e.close()


def test_overlap_under_a_small_cache_preempts_only_in_step(tiny_llama_path):
    """12 blocks of 4 tokens for 6 requests: sequences wait or are preempted and recomputed; the
    tokens stay those of the engine without overlap."""
    want, _, _ = _tokens(tiny_llama_path, num_kv_blocks=12, overlap_schedule="off")
    got, _, e = _tokens(tiny_llama_path, num_kv_blocks=12, overlap_schedule="on")
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


def test_overlap_is_on_with_cuda_by_default():
    from xinfer.config import EngineConfig as C
    assert C(device="cpu").resolve({}).overlap_schedule == "off"
    assert C(device="cuda").resolve({}).overlap_schedule == "on"
    assert C(device="cpu", overlap_schedule="on").resolve({}).overlap_schedule == "on"
    import pytest
    with pytest.raises(ValueError, match="--overlap-schedule"):
        C(overlap_schedule="yes")


def test_overlap_with_a_worker_process_survives_its_death(tiny_llama_path):
    """Serving's shape: the worker in its own process, steps sent ahead through the rings. kill -9 of
    the worker with a step in flight and one sent ahead: both are lost, every sequence is recomputed
    and ends with the tokens of one step at a time."""
    import os
    import signal
    want, _, _ = _tokens(tiny_llama_path, num_kv_blocks=64, overlap_schedule="off")
    e = Engine(EngineConfig(model=tiny_llama_path, block_size=4, num_kv_blocks=64, overlap_schedule="on"),
               worker="process", log_level="warning")
    try:
        assert [(o.token_ids, o.finish_reason) for o in e.generate(PROMPTS, PARAMS)] == want
        ids = [e.add_request(p, q)[0] for p, q in zip(PROMPTS, PARAMS)]
        toks, reasons, steps = {i: [] for i in ids}, {}, 0
        while e.has_unfinished():
            if steps == 3:
                assert e.core._pending is not None  # a step was sent ahead when the worker died
                os.kill(e.runner.proc.pid, signal.SIGKILL)
            for d in e.step():
                toks[d.seq_id].extend(d.token_ids)
                if d.finish_reason:
                    reasons[d.seq_id] = d.finish_reason
            steps += 1
        assert [(toks[i], reasons[i]) for i in ids] == want and e.runner.restarts == 1
        e.blocks.check_integrity()
    finally:
        e.close()


def test_served_with_overlap_streams_stops_and_aborts():
    """`xinfer serve --overlap-schedule on` on the bundled model: concurrent streams (one ending on a
    stop string, one dropped by its client mid-stream) all end as they would one step at a time,
    and the server serves the next request."""
    import concurrent.futures

    import openai
    from tests.conftest import start_server, stop_server
    proc, base, _ = start_server("--kv-cache-gb", "0.2", "--overlap-schedule", "on")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x")
        msgs = [[{"role": "user", "content": f"Count from {i} to {i + 20}, one number a line."}] for i in range(4)]

        def chat(i):
            kw = {"stop": ["\n"]} if i == 1 else {}
            if i == 2:  # the client leaves after a few chunks
                with client.chat.completions.create(model="m", messages=msgs[i], max_tokens=60, temperature=0,
                                                    stream=True) as s:
                    for n, _ in enumerate(s):
                        if n == 3:
                            break
                return None
            r = client.chat.completions.create(model="m", messages=msgs[i], max_tokens=40, temperature=0, **kw)
            return r.choices[0].message.content, r.choices[0].finish_reason
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            got = list(ex.map(chat, range(4)))
        want = [client.chat.completions.create(model="m", messages=msgs[i], max_tokens=40, temperature=0,
                                               **({"stop": ["\n"]} if i == 1 else {})) for i in (0, 1, 3)]
        assert [got[i] for i in (0, 1, 3)] == [(r.choices[0].message.content, r.choices[0].finish_reason) for r in want]
        assert got[1][1] == "stop" and "\n" not in got[1][0]
    finally:
        stop_server(proc)


class _Plans:
    """A plan ring's reader: `arrivals` lists, per look at the ring, the plan that has come by then (or None)."""

    def __init__(self, arrivals):
        self.arrivals = list(arrivals)

    def poll(self):
        return bool(self.arrivals) and (self.arrivals[0] is not None or self.arrivals.pop(0) is not None)

    def read(self, timeout=None):
        while self.arrivals:
            plan = self.arrivals.pop(0)
            if plan is not None:
                return plan
            if timeout is not None:
                raise TimeoutError
        if timeout is not None:
            raise TimeoutError
        raise RingClosed("no more plans")  # the worker waits with nothing to do: the test is over


class _Runner:
    """The worker loop's view of a ModelRunner; the device stays busy for `busy_looks` looks after each launch."""

    def __init__(self, busy_looks):
        self.busy_looks, self.looks, self.flight, self.events = busy_looks, 0, [], []

    def in_flight(self):
        return len(self.flight)

    def busy(self):
        self.looks -= 1
        return bool(self.flight) and self.looks >= 0

    def ready(self, plan):
        return len(self.flight) < 2

    def start(self, plan):
        self.events.append(("start", plan))
        self.flight.append(plan)
        self.looks = self.busy_looks

    def finish(self):
        self.events.append(("finish", self.flight[0]))
        return StepResult(self.flight.pop(0), [], b"")


def test_the_worker_waits_for_the_next_plan_while_the_device_is_busy():
    """Serving's shape: the scheduler sends step 2 a little after step 1. While step 1 still runs on
    the device the worker waits for it and launches it behind step 1, rather than blocking on step 1's
    tokens first; with the device done it finishes at once."""
    from xinfer.workers.worker import serve_plans

    class Codec:
        decode = encode = staticmethod(lambda x: x)
    sent = []
    for busy_looks, order in ((5, ["start 1", "start 2", "finish 1", "finish 2"]),
                              (0, ["start 1", "finish 1", "start 2", "finish 2"])):
        runner = _Runner(busy_looks)
        with pytest.raises(RingClosed):
            serve_plans(_Plans([1, None, None, 2]), runner, Codec, sent.append, Codec)
        assert [f"{k} {p}" for k, p in runner.events] == order
    assert [r.step_id for r in sent] == [1, 2, 1, 2]

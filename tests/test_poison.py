"""The poison-pill rule: a request that makes the model step fail (an exception, or the worker
process dying) is isolated and, if it fails again alone, ended with an error; every other request
finishes with the tokens it would have had."""
import os
import signal

import pytest

from xinfer import Engine, EngineConfig, SamplingParams

PROMPTS = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [9, 8, 7], [20] * 30, [1, 2]]
POISON = [66, 66, 66, 66]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_llama_path):
    e = Engine(EngineConfig(model=tiny_llama_path, num_kv_blocks=64, block_size=4))
    return [o.token_ids for o in e.generate(PROMPTS, GREEDY)]


def _run(engine, prompts, kill_at=()):
    ids = [engine.add_request(p, GREEDY)[0] for p in prompts]
    toks, reasons, errors, steps = {i: [] for i in ids}, {}, {}, 0
    while engine.has_unfinished():
        if steps in kill_at:
            os.kill(engine.runner.proc.pid, signal.SIGKILL)
        for d in engine.step():
            toks[d.seq_id].extend(d.token_ids)
            if d.finish_reason:
                reasons[d.seq_id], errors[d.seq_id] = d.finish_reason, d.error
        steps += 1
    return [toks[i] for i in ids], [reasons[i] for i in ids], [errors[i] for i in ids]


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_step_that_raises_ends_only_its_request(tiny_llama_path, reference, monkeypatch, pipelined):
    """Also with pipelined steps (CUDA's default, xinfer/workers/pipeline.py): the step launched
    after a failed one fails with it, and both are recomputed."""
    monkeypatch.setenv("XINFER_CPU_PIPELINE", "1" if pipelined else "0")
    e = Engine(EngineConfig(model=tiny_llama_path, num_kv_blocks=64, block_size=4,
                            overlap_schedule="on" if pipelined else "off"))
    real = e.runner._launch
    poisoned = set()

    def execute(plan):
        for ns in plan.new_seqs:
            if e.core.scheduler.seqs[ns.seq_id].prompt_ids == POISON:
                poisoned.add(ns.seq_id)
        if any(s.seq_id in poisoned for s in plan.scheduled):
            raise IndexError("index 9223372036854775807 is out of bounds")  # what a bad value did once
        return real(plan)

    monkeypatch.setattr(e.runner, "_launch", execute)
    toks, reasons, errors = _run(e, PROMPTS[:2] + [POISON] + PROMPTS[2:])
    assert toks[:2] + toks[3:] == reference
    assert reasons == ["length", "length", "error", "length", "length"]
    assert "could not be run" in errors[2] and "IndexError" in errors[2]
    e.blocks.check_integrity()
    assert [o.token_ids for o in e.generate(PROMPTS, GREEDY)] == reference  # and it goes on serving


def test_a_request_whose_replay_kills_a_second_worker_is_ended(tiny_llama_path, reference):
    """Two worker deaths: the first puts the step's sequences under watch, each runs alone; the one
    running alone when the second death comes is ended with an error, the rest finish unchanged."""
    e = Engine(EngineConfig(model=tiny_llama_path, num_kv_blocks=64, block_size=4), worker="process",
               log_level="warning")
    try:
        toks, reasons, errors = _run(e, PROMPTS, kill_at=(3, 5))
        assert reasons.count("error") == 1 and e.runner.restarts == 2
        bad = reasons.index("error")
        assert "worker died" in errors[bad]
        assert [t for i, t in enumerate(toks) if i != bad] == [t for i, t in enumerate(reference) if i != bad]
        e.blocks.check_integrity()
    finally:
        e.close()

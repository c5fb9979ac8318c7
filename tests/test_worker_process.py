"""The model worker in its own process: same tokens as in-process, and a worker killed
mid-generation is replaced with every request recomputed to the same greedy output."""
import os
import signal

import pytest

from xinfer import Engine, EngineConfig, SamplingParams

PROMPTS = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [9, 8, 7], [20] * 30, [1, 2]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_llama_path):
    e = Engine(EngineConfig(model=tiny_llama_path, num_kv_blocks=64, block_size=4))
    return [o.token_ids for o in e.generate(PROMPTS, GREEDY)], [o.token_ids for o in e.generate(PROMPTS, SEEDED)]


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    e = Engine(EngineConfig(model=tiny_llama_path, num_kv_blocks=64, block_size=4), worker="process",
               log_level="warning")
    yield e
    e.close()


def test_same_tokens_as_in_process(engine, reference):
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference[0]


@pytest.mark.parametrize("which", [0, 1])
def test_killed_worker_is_replaced_by_recompute(engine, reference, which):
    params = [GREEDY, SEEDED][which]
    ids = [engine.add_request(p, params)[0] for p in PROMPTS]
    toks = {i: [] for i in ids}
    steps = 0
    restarts = engine.runner.restarts
    while engine.has_unfinished():
        if steps == 6:
            os.kill(engine.runner.proc.pid, signal.SIGKILL)
        for d in engine.step():
            toks[d.seq_id].extend(d.token_ids)
        steps += 1
    assert engine.runner.restarts == restarts + 1
    assert [toks[i] for i in ids] == reference[which]
    engine.blocks.check_integrity()


def test_garbage_plan_frame_is_rejected_and_recovered(engine, reference):
    """A frame in the plan ring that is not a StepPlan: the worker logs it and answers step -1,
    and the engine rebuilds the worker's state by recompute; outputs are unchanged."""
    from xinfer.ipc.step import StepResult
    engine.runner.plans.write(b"\xc1 definitely not msgpack")
    result = engine.runner._codec.decode(engine.runner.results.read(timeout=30))
    assert isinstance(result, StepResult) and result.step_id == -1
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference[0]


def test_garbage_zmq_frames_are_dropped(caplog):
    from xinfer.ipc.api import FromEngine, ToEngine
    from xinfer.ipc.channels import Codec
    for typ in (ToEngine, FromEngine):
        assert Codec(typ).decode(b"\x93\xa3bad\x01\x02") is None
        assert Codec(typ).decode(b"") is None
    assert "undecodable frame" in caplog.text


def test_workers_see_the_environment_they_are_started_in(monkeypatch):
    """Workers fork from a server that imported xinfer once; a later change to the environment gets
    a freshly spawned worker, whose modules read it."""
    from xinfer.workers import fork_server
    monkeypatch.setattr(fork_server, "_fork_env", None)
    assert fork_server.worker_context().get_start_method() == "forkserver"
    monkeypatch.setenv("XINFER_TEST_MARKER", "1")
    assert fork_server.worker_context().get_start_method() == "spawn"

"""The model worker process, and the scheduler-side handle that drives it.

The scheduler writes each StepPlan into a shared-memory ring that every worker reads
(one today: one device), and reads the StepResult back from a second ring. Each worker
generation gets fresh rings: a worker that dies is replaced by a new process and the
scheduler recomputes the lost state from the tokens it holds.
"""
from __future__ import annotations

import collections
import logging
import multiprocessing as mp
import os
import signal
import time

import msgspec

from xinfer.config import EngineConfig
from xinfer.errors import XinferError
from xinfer.ipc import launch
from xinfer.ipc.channels import Codec, endpoint
from xinfer.ipc.shm_ring import PeerDied, RingClosed, RingReader, RingWriter, create_ring
from xinfer.ipc.step import StepPlan, StepResult

log = logging.getLogger("xinfer.worker")

PLAN_SLOT = 1 << 18  # longer plans (very long new prompts) overflow to the side channel
RESULT_SLOT = 1 << 16


class WorkerReady(msgspec.Struct, array_like=True, tag="ready"):
    pid: int


class WorkerDied(RuntimeError):
    pass


class TooManyRestarts(XinferError):
    pass


class RestartBudget:
    """--max-restarts child restarts within --restart-window seconds, shared by every child
    the engine restarts (the worker, the detokenizer, the parser); one more is an error."""

    def __init__(self, max_restarts: int, window: float):
        self.max, self.window = max_restarts, window
        self.times: collections.deque[float] = collections.deque()

    def record(self, child: str, why: str) -> None:
        now = time.monotonic()
        self.times.append(now)
        while self.times and now - self.times[0] > self.window:
            self.times.popleft()
        if len(self.times) > self.max:
            raise TooManyRestarts(f"{child} died ({why}): {len(self.times)} child restarts within "
                                  f"{self.window:g}s, more than --max-restarts {self.max} allows; giving up")


def run_worker(config: EngineConfig, num_blocks: int, plan_ring: str, result_ring: str, plan_side: str,
               result_side: str, rank: int, log_level: str) -> None:
    from xinfer.cli import setup_logging, set_title
    from xinfer.loader import load_model_info
    from xinfer.workers.model_runner import ModelRunner

    name = f"xinfer::worker-{rank}"
    setup_logging(log_level, name)
    set_title(name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's to handle
    launch.exit_with_parent(os.getppid())  # the rings watch the scheduler too, once loaded
    plans = RingReader(plan_ring, rank, plan_side)
    results = RingWriter(result_ring, [result_side])
    try:
        runner = ModelRunner(config, load_model_info(config.model, config.load_format), num_blocks)
    except Exception as e:
        log.debug("start-up failed", exc_info=True)
        log.error("could not start: %s", e)
        launch.failed(name, f"{type(e).__name__}: {e}" if not isinstance(e, XinferError) else str(e))
        raise SystemExit(1)
    enc = msgspec.msgpack.Encoder()
    dec = Codec(StepPlan)
    launch.started(name)
    results.write(enc.encode(WorkerReady(os.getpid())))
    while True:
        try:
            frame = plans.read()
        except (PeerDied, RingClosed):
            log.info("scheduler gone or shutting down; exiting")
            # Nothing to clean up here (the scheduler owns the rings), and tearing down an
            # interpreter with torch loaded takes seconds: leave at once.
            logging.shutdown()
            os._exit(0)
        plan = dec.decode(frame)
        # An undecodable plan is answered with step -1: the scheduler then rebuilds this
        # worker's state by recompute instead of waiting for a result that never comes.
        result = runner.execute(plan) if plan is not None else StepResult(-1, [], b"")
        results.write(enc.encode(result))


class ProcessRunner:
    """Scheduler-side stand-in for a ModelRunner that lives in a worker process."""

    def __init__(self, config: EngineConfig, num_blocks: int, rundir: str, log_level: str = "info",
                 startup_timeout: float = 600.0):
        self.config, self.num_blocks, self.rundir = config, num_blocks, rundir
        self.log_level, self.startup_timeout = log_level, startup_timeout
        self.generation = 0
        self.restarts = 0
        self.proc = None
        self._shms = []
        self._codec = Codec(StepResult | WorkerReady)
        self._enc = msgspec.msgpack.Encoder()
        self._start()

    def _start(self) -> None:
        self.generation += 1
        g = self.generation
        tag = f"xinfer-{os.getpid()}-{g}"
        self._shms = [create_ring(1, 8, PLAN_SLOT, name=f"{tag}-plan"), create_ring(1, 8, RESULT_SLOT,
                                                                                     name=f"{tag}-result")]
        plan_side, result_side = endpoint(self.rundir, f"plan-side-{g}"), endpoint(self.rundir, f"result-side-{g}")
        self.plans = RingWriter(self._shms[0].name, [plan_side])
        self.results = RingReader(self._shms[1].name, 0, result_side)
        self.proc = mp.get_context("spawn").Process(
            target=run_worker, name="xinfer::worker-0", daemon=True,
            args=(self.config, self.num_blocks, self._shms[0].name, self._shms[1].name, plan_side, result_side,
                  0, self.log_level))
        self.proc.start()
        try:
            msg = self._wait_ready()
        except BaseException:  # also SIGTERM meanwhile: release the rings before unwinding
            self.proc.kill()  # still starting: nothing to finish gracefully
            self.proc.join(5)
            self._teardown()
            raise
        if not isinstance(msg, WorkerReady):
            raise WorkerDied("the worker sent something other than its ready message")
        log.info("worker %d ready (pid %d)", g, msg.pid)

    def _wait_ready(self):
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                return self._codec.decode(self.results.read(timeout=0.5))
            except (TimeoutError, PeerDied):
                if not self.proc.is_alive():
                    self.proc.join()
                    raise WorkerDied(f"the worker exited during start-up (exit code {self.proc.exitcode}); "
                                     "see its log above") from None
                if time.monotonic() > deadline:
                    self.proc.kill()
                    raise WorkerDied(f"the worker did not start within {self.startup_timeout:.0f}s") from None

    def execute(self, plan: StepPlan) -> StepResult:
        try:
            self.plans.write(self._enc.encode(plan))
            result = self._codec.decode(self.results.read())
        except PeerDied as e:
            raise WorkerDied(str(e)) from None
        if not isinstance(result, StepResult) or result.step_id != plan.step_id:
            raise WorkerDied(f"the worker answered step {plan.step_id} with {result!r:.80}")
        return result

    def restart(self) -> None:
        self.restarts += 1
        self._teardown()
        self._start()

    def _teardown(self) -> None:
        if not self._shms:
            return  # already done (a restart whose start failed)
        if self.proc is not None and self.proc.is_alive():
            self.plans.shutdown()
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
        for ring in (self.plans, self.results):
            for s in ring.side if isinstance(ring.side, list) else [ring.side]:
                if s is not None:
                    s.close()
            ring.close()
        for shm in self._shms:
            shm.close()
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
        self._shms = []

    def close(self) -> None:
        self._teardown()

"""The model worker process, and the scheduler-side handle that drives it.

The scheduler writes each StepPlan into a shared-memory ring that every worker reads
(one today: one device), and reads the StepResult back from a second ring. Each worker
generation gets fresh rings: a worker that dies is replaced by a new process and the
scheduler recomputes the lost state from the tokens it holds.
"""
from __future__ import annotations

import collections
import logging
import os
import time

import msgspec
import torch

from xinfer import parallel as tp
from xinfer import process
from xinfer.config import EngineConfig
from xinfer.ipc import cluster
from xinfer.ipc.channels import Codec
from xinfer.ipc.shm_ring import PeerDied, RingClosed, RingReader, RingWriter, create_ring
from xinfer.ipc.step import StepPlan, StepResult
from xinfer.ipc.topology import Topology
from xinfer.loader import load_model_info
from xinfer.workers import fork_server
from xinfer.workers.model_runner import ModelRunner
from xinfer.workers.runner import WorkerDied

log = logging.getLogger("xinfer.worker")

PLAN_SLOT = 1 << 18  # longer plans (very long new prompts) overflow to the side channel
RESULT_SLOT = 1 << 16


class WorkerReady(msgspec.Struct, array_like=True, tag="ready"):
    pid: int
    num_blocks: int  # the KV cache it allocated (sized after the weights loaded)


def run_worker(config: EngineConfig, num_blocks: int | None, plan_ring: str, result_ring: str, plan_side: str,
               result_side: str, rank: int, reader: int, log_level: str, store: str = "") -> None:
    process.run_process(f"xinfer::worker-{rank}", log_level, _worker_main, config, num_blocks, plan_ring,
                        result_ring, plan_side, result_side, rank, reader, store, parent=os.getppid())


def _worker_main(config, num_blocks, plan_ring, result_ring, plan_side, result_side, rank, reader, store) -> None:
    """World rank `rank` of the tensor x pipeline parallel workers, reader `reader` of its node's
    plan ring: each reads every plan; rank 0 answers."""
    plans = RingReader(plan_ring, reader, plan_side)  # the rings watch the scheduler's liveness too
    tp.init(rank, config, store, torch.device(config.device))
    results = RingWriter(result_ring, [result_side]) if rank == 0 else None
    runner = ModelRunner(config, load_model_info(config.model, config.load_format), num_blocks)
    enc = msgspec.msgpack.Encoder()
    dec = Codec(StepPlan)
    process.started(f"xinfer::worker-{rank}")
    if results is not None:
        results.write(enc.encode(WorkerReady(os.getpid(), runner.num_blocks)))
    try:
        serve_plans(plans, runner, dec, results.write if results is not None else None, enc)
    except (PeerDied, RingClosed):
        log.info("scheduler gone or shutting down; exiting")
        # Nothing to clean up here (the scheduler owns the rings), and tearing down an
        # interpreter with torch loaded takes seconds: leave at once.
        logging.shutdown()
        os._exit(0)


PLAN_WAIT = 2e-4  # seconds between looks at the device while waiting for the next plan


def serve_plans(plans: RingReader, runner: ModelRunner, dec: Codec, write, enc) -> None:
    """The worker's loop: read plans, launch them, send back results (rank 0's `write`), until
    the ring closes. The next step is launched before the last one's tokens are read where it can
    be (xinfer/workers/pipeline.py), so the device runs one while the host finishes the other."""
    queue: collections.deque = collections.deque()  # plans read, not yet launched
    while True:
        # wait for a plan only with nothing to do; take whatever else has come meanwhile
        if not queue and not runner.in_flight():
            queue.append(dec.decode(plans.read()))
        while plans.poll():
            queue.append(dec.decode(plans.read()))
        if not queue and runner.busy():
            # The device still runs the step in flight and the scheduler is planning the next:
            # finishing now would block on the device and launch the next step only after it.
            while runner.busy():
                try:
                    queue.append(dec.decode(plans.read(timeout=PLAN_WAIT)))
                    break
                except TimeoutError:
                    pass
        if queue and queue[0] is not None and runner.ready(queue[0]):
            runner.start(queue.popleft())
            continue  # and look for a plan that came meanwhile before reading this one's tokens
        if runner.in_flight():
            result = runner.finish()
        else:
            # An undecodable plan is answered with step -1: the scheduler then rebuilds this
            # worker's state by recompute instead of waiting for a result that never comes.
            queue.popleft()
            result = StepResult(-1, [], b"")
        if write is not None:
            write(enc.encode(result))


class Ranks:
    """One generation of this node's worker ranks: a plan ring they all read, and the processes.
    Node 0's also have the result ring that rank 0 answers on (ProcessRunner); a headless node's
    have none (xinfer/workers/headless.py)."""

    def __init__(self, config: EngineConfig, topology: Topology, gen: int, num_blocks: int | None, log_level: str,
                 results: bool):
        t = topology
        world = config.tensor_parallel_size * config.pipeline_parallel_size
        n = world // config.nnodes
        first = config.node_rank * n  # this node's world ranks: first .. first + n - 1
        self.shms = [create_ring(n, 8, PLAN_SLOT, name=t.ring("plan", gen))]
        if results:
            self.shms.append(create_ring(1, 8, RESULT_SLOT, name=t.ring("result", gen)))
        plan_sides, result_side = [t.plan_side(gen, r) for r in range(n)], t.result_side(gen) if results else ""
        self.plans = RingWriter(self.shms[0].name, plan_sides)
        self.results = RingReader(self.shms[1].name, 0, result_side) if results else None
        # the ranks' rendezvous: a file on one node; across nodes, the TCP store rank 0 hosts
        store = "" if world == 1 else f"file://{t.tp_store(gen)}" if config.nnodes == 1 else \
            f"tcp://{config.master_addr}:{config.master_port}"
        self.procs = [fork_server.worker_context().Process(
            target=run_worker, name=f"xinfer::worker-{first + r}", daemon=True,
            args=(config, num_blocks, self.shms[0].name, self.shms[1].name if results else "", plan_sides[r],
                  result_side, first + r, r, log_level, store)) for r in range(n)]
        for p in self.procs:
            p.start()

    def dead(self) -> str | None:
        for r, p in enumerate(self.procs):
            if not p.is_alive():
                return f"exit code {p.exitcode}" + (f" of {p.name.removeprefix('xinfer::')}" if r or len(self.procs) > 1 else "")
        return None

    def kill(self) -> None:
        for p in self.procs:
            p.kill()  # still starting: nothing to finish gracefully
            p.join(5)

    def close(self) -> None:
        if not self.shms:
            return  # already done (a restart whose start failed)
        if any(p.is_alive() for p in self.procs):
            self.plans.shutdown()
            for p in self.procs:  # a rank waiting in a collective for a dead one never sees the shutdown
                p.join(5 if len(self.procs) == 1 or all(q.is_alive() for q in self.procs) else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join(5)
        for ring in (self.plans, self.results):
            if ring is None:
                continue
            for s in ring.side if isinstance(ring.side, list) else [ring.side]:
                if s is not None:
                    s.close()
            ring.close()
        for shm in self.shms:
            shm.close()
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
        self.shms = []


class ProcessRunner:
    """The Runner (xinfer/workers/runner.py) whose ModelRunner lives in worker processes: one per
    rank on this node, and with --nnodes, the headless nodes' ranks, which get each generation's
    start and plans from the cluster.Publisher."""

    def __init__(self, config: EngineConfig, topology: Topology, log_level: str = "info"):
        self.config, self.topology = config, topology
        self.num_blocks = config.num_kv_blocks  # None until the first worker has sized the cache
        self.log_level, self.startup_timeout = log_level, config.startup_timeout
        self.generation = 0
        self.restarts = 0
        self.ranks: Ranks | None = None
        self._sent: collections.deque[int] = collections.deque()  # step ids sent, results not yet read
        self._codec = Codec(StepResult | WorkerReady)
        self._enc = msgspec.msgpack.Encoder()
        self.net = None
        if config.nnodes > 1:
            self.net = cluster.Publisher(config.master_addr, config.master_port, config.cluster_key)
            self._config_json = msgspec.json.encode(config)
        self._start()

    @property
    def procs(self):
        return self.ranks.procs if self.ranks else []

    @property
    def proc(self):
        return self.procs[0] if self.procs else None

    @property
    def plans(self):
        return self.ranks.plans

    @property
    def results(self):
        return self.ranks.results

    def _start(self) -> None:
        self.generation += 1
        g = self.generation
        self.ranks = Ranks(self.config, self.topology, g, self.num_blocks, self.log_level, results=True)
        try:
            msg = self._wait_ready()
        except BaseException:  # also SIGTERM meanwhile: release the rings before unwinding
            self.ranks.kill()
            self._teardown()
            raise
        if not isinstance(msg, WorkerReady):
            raise WorkerDied("the worker sent something other than its ready message")
        self.num_blocks = msg.num_blocks
        log.info("worker %d ready (pid %d)", g, msg.pid)

    def _wait_ready(self):
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.net is not None:  # again and again: a node that joins late still hears it
                self.net.start(self.generation, self._config_json, self.num_blocks)
            try:
                return self._codec.decode(self.ranks.results.read(timeout=0.5))
            except (TimeoutError, PeerDied):
                why = self.dead()
                if why:
                    raise WorkerDied(f"the worker exited during start-up ({why}); see its log above") from None
                if time.monotonic() > deadline:
                    c = self.config
                    nodes = (f"; with --nnodes {c.nnodes}: is `xinfer serve --headless --nnodes {c.nnodes} --node-rank K "
                             f"--master-addr {c.master_addr} --master-port {c.master_port}` (and the same --cluster-key) "
                             f"running on each other node, and can it reach {c.master_addr}:{c.master_port}-"
                             f"{c.master_port + 1}?" if c.nnodes > 1 else "")
                    raise WorkerDied(f"the worker ranks did not start within --startup-timeout "
                                     f"{self.startup_timeout:g}s{nodes}") from None

    def submit(self, plan: StepPlan) -> None:
        try:
            frame = self._enc.encode(plan)
            self.ranks.plans.write(frame)
        except PeerDied as e:
            raise WorkerDied(str(e)) from None
        if self.net is not None:
            self.net.plan(self.generation, frame)
        self._sent.append(plan.step_id)

    def collect(self) -> StepResult:
        ranks, step = self.ranks, self._sent.popleft()
        try:
            while True:  # rank 0 answers; another rank's death would leave it waiting in a collective
                try:
                    single = len(ranks.procs) == 1 and self.net is None
                    result = self._codec.decode(ranks.results.read(timeout=None if single else 0.5))
                    break
                except TimeoutError:
                    why = self.dead()
                    if why:
                        raise WorkerDied(why) from None
        except PeerDied as e:
            raise WorkerDied(str(e)) from None
        if not isinstance(result, StepResult) or result.step_id != step:
            raise WorkerDied(f"the worker answered step {step} with {result!r:.80}")
        return result

    def dead(self) -> str | None:
        return self.ranks.dead() if self.ranks else None

    def restart(self) -> None:
        self.restarts += 1
        self._teardown()
        self._start()

    def _teardown(self) -> None:
        self._sent.clear()
        if self.net is not None:
            self.net.stop(self.generation)
        if self.ranks is not None:
            self.ranks.close()

    def close(self) -> None:
        self._teardown()
        if self.net is not None:
            self.net.close()
            self.net = None

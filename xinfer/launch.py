"""xinfer-launch: the supervisor (`xinfer serve` and `xinfer-launch` run it).

    xinfer::launch                 this process: starts, watches and stops the others
    ├── xinfer::api                Sanic on uvloop, the only network listener
    └── xinfer::scheduler          the engine core: owns every request's tokens
        ├── xinfer::worker-fork    imports torch once; each worker is forked from it
        │   └── xinfer::worker-0   the model (restarted by the scheduler, by recompute)
        ├── xinfer::detokenizer    (restarted by the scheduler, resynchronised)
        └── xinfer::parser         (restarted with the detokenizer)

Start-up is ordered, with a ready handshake: the supervisor binds a ZMQ PULL socket in its
private 0700 runtime directory and names it in the XINFER_LAUNCH environment variable; each
xinfer process pushes `Started` (msgspec, xinfer/ipc/launch.py) when it is ready, or `Failed`
with its error text. The API goes first: it listens at once and answers /health 503 while the
model loads. Then the scheduler: it loads the model, starts the worker, the detokenizer and the
parser, and reports which children to wait for. All within --startup-timeout. When every one
has reported, the supervisor sends the API SIGUSR1 and /health turns 200. A child that fails
to start stops the launch with its message (exit code 1).

Once running: if the API or the scheduler dies, the rest is stopped and the exit code is 1.
The scheduler itself restarts a dead worker, detokenizer or parser (it holds the token history
that makes a restart lossless); more than --max-restarts restarts within --restart-window
seconds make it stop with a message naming the child, and the supervisor shuts down (1).
SIGTERM or SIGINT: the API drains (503 for new requests, in-flight ones finish up to
--drain-timeout), then the scheduler stops, the runtime directory is removed, exit code 0; a
second signal skips the rest of the drain. Every child watches its parent, so none survives
even a SIGKILL of the supervisor.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket as socketlib
import sys
import time

import zmq

from xinfer import envs, process
from xinfer.config import EngineConfig
from xinfer.ipc import launch as msgs
from xinfer.ipc.channels import Codec, socket
from xinfer.ipc.topology import Topology

log = logging.getLogger("xinfer.launch")

API, SCHEDULER = "xinfer::api", "xinfer::scheduler"


class LaunchFailed(Exception):
    """Stops the launch; the message is shown to the user."""


# The children's entry points, named by module so the supervisor never imports them: it stays
# small, and the API process (spawned) imports only the API.
API_ENTRY, SCHEDULER_ENTRY = ("xinfer.api.server", "serve"), ("xinfer.engine_core_proc", "run_engine_core")


def _run(entry, *args) -> None:
    import importlib
    if entry == SCHEDULER_ENTRY:  # the workers' fork server imports torch beside the scheduler's own imports
        from xinfer.workers import fork_server
        fork_server.start()
    getattr(importlib.import_module(entry[0]), entry[1])(*args)


class Supervisor:
    def __init__(self, config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                 max_queued_requests: int = 256, drain_timeout: float = 30.0, startup_timeout: float = 600.0,
                 api_options: dict | None = None):
        self.config, self.host, self.port, self.log_level = config, host, port, log_level
        self.api_options = api_options or {}
        self.max_queued_requests, self.drain_timeout = max_queued_requests, drain_timeout
        self.startup_timeout = startup_timeout
        self.procs: dict[str, mp.process.BaseProcess] = {}
        self.started: dict[str, int] = {}  # name -> pid of its latest Started
        self.pids: set[int] = set()  # every xinfer process that reported: none may outlive us
        self.expect: set[str] = set()
        self.failures: list[msgs.Failed] = []
        self.signals = 0
        self.ready = False

    # ---- the whole life ----
    def run(self) -> int:
        self.topology = Topology.create()
        self.rundir = self.topology.rundir
        self.ctx = zmq.Context()
        self.inbox = socket(self.ctx, zmq.PULL, self.topology.launch, bind=True)
        self.codec = Codec(msgs.LaunchMessage)
        os.environ[envs.LAUNCH] = self.topology.launch  # every process started from here reports to the inbox
        # A signal or a child's exit wakes the wait on the inbox at once (a byte on this pair), so a
        # stop or a death is acted on now, not at the end of the wait.
        self.wake, wake_w = socketlib.socketpair()
        for end in (self.wake, wake_w):
            end.setblocking(False)
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self.poller.register(self.wake, zmq.POLLIN)
        old_fd = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        old[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, lambda *_: None)
        try:
            return self._run()
        except LaunchFailed as e:
            print(f"xinfer: error: {e}", file=sys.stderr, flush=True)
            return 1
        finally:
            self._stop_all()
            for s, h in old.items():
                signal.signal(s, h)
            signal.set_wakeup_fd(old_fd)
            self.wake.close()
            wake_w.close()
            os.environ.pop(envs.LAUNCH, None)
            self.inbox.close()
            self.ctx.term()
            shutil.rmtree(self.rundir, ignore_errors=True)

    def _run(self) -> int:
        deadline = time.monotonic() + self.startup_timeout
        self._start(API, API_ENTRY, (self.config, self.topology, self.host, self.port, self.log_level,
                                     self.max_queued_requests, self.drain_timeout, os.getpid(), self.api_options))
        if not self._wait_started({API}, deadline):
            return 0
        self._start(SCHEDULER, SCHEDULER_ENTRY, (self.config, self.topology, self.log_level, os.getpid()))
        if not self._wait_started({SCHEDULER}, deadline):
            return 0
        self.ready = True
        os.kill(self.procs[API].pid, signal.SIGUSR1)  # every process is up: /health turns 200
        log.info("ready on %s://%s:%d (%s)", "https" if self.api_options.get("ssl_certfile") else "http",
                 self.host, self.port,
                 ", ".join(f"{n} {p}" for n, p in self.started.items()))
        return self._watch()

    def _on_signal(self, signum, frame) -> None:
        self.signals += 1
        api = self.procs.get(API)
        if self.signals == 1 and api is not None and api.pid and api.is_alive():
            os.kill(api.pid, signal.SIGTERM)  # the drain starts now, not at the next turn of the watch loop

    # ---- start-up ----
    def _start(self, name: str, entry: tuple[str, str], args) -> None:
        p = mp.get_context("spawn").Process(target=_run, name=name, args=(entry, *args))
        p.start()
        self.procs[name] = p

    def _wait_started(self, names: set[str], deadline: float) -> bool:
        """Wait until `names` (and the children they announce) are ready; False if a signal
        asked us to stop meanwhile."""
        self.expect |= names
        while not self.expect <= self.started.keys():
            if self.signals:
                log.warning("stopping during start-up")
                return False
            self._receive(0.25)
            if self.failures:
                f = self.failures[0]
                raise LaunchFailed(f"{f.name} failed to start: {f.message}")
            for name, p in self.procs.items():
                if not p.is_alive():
                    self._receive(0.5)  # its Failed message may still be on the way
                    if self.failures:
                        f = self.failures[0]
                        raise LaunchFailed(f"{f.name} failed to start: {f.message}")
                    raise LaunchFailed(f"{name} exited during start-up (exit code {p.exitcode}); see the log above")
            if time.monotonic() > deadline and not self.expect <= self.started.keys():
                missing = ", ".join(sorted(self.expect - self.started.keys()))
                raise LaunchFailed(f"start-up timed out after {self.startup_timeout:g}s waiting for {missing} "
                                   "(a big model may need a larger --startup-timeout)")
        return True

    def _receive(self, timeout: float) -> None:
        """Handle the messages that arrive within `timeout` seconds, or until a signal or a child's exit."""
        wait = int(timeout * 1000)
        while events := dict(self.poller.poll(wait)):
            wait = 0
            if self.wake.fileno() in events:
                try:
                    while self.wake.recv(64):
                        pass
                except BlockingIOError:
                    pass
            if self.inbox not in events:
                continue
            msg = self.codec.decode(self.inbox.recv())
            if isinstance(msg, msgs.Started):
                if self.ready:
                    log.info("%s restarted (pid %d)", msg.name, msg.pid)
                self.started[msg.name] = msg.pid
                self.failures = [f for f in self.failures if f.name != msg.name]  # it came back
                self.pids.add(msg.pid)
                self.expect |= set(msg.expect)
            elif isinstance(msg, msgs.Failed):
                log.debug("%s failed: %s", msg.name, msg.message)
                self.failures.append(msg)

    # ---- running ----
    def _watch(self) -> int:
        while True:
            if self.signals:
                return self._drain()
            self._receive(0.5)
            for name in (SCHEDULER, API):  # the scheduler first: its death also stops the API
                p = self.procs[name]
                if not p.is_alive():
                    if self.signals and name == API:  # a signal came meanwhile: it drained and exited
                        return self._drain()
                    self._receive(0.5)  # its Failed, if it sent one
                    why = "; ".join(f"{f.name}: {f.message}" for f in self.failures) or \
                        f"exited unexpectedly (exit code {p.exitcode})"
                    who = "" if self.failures else name + " "
                    print(f"xinfer: error: {who}{why}; shutting down", file=sys.stderr, flush=True)
                    return 1

    def _drain(self) -> int:
        """SIGTERM/SIGINT: the API stops admitting and lets in-flight requests finish (it knows
        --drain-timeout), then exits; a second signal cuts the drain short."""
        api, seen = self.procs[API], self.signals
        log.info("stopping: draining in-flight requests (up to %gs)", self.drain_timeout)
        if api.is_alive():
            os.kill(api.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.drain_timeout + 15
        while api.is_alive() and time.monotonic() < deadline:
            if self.signals > seen:
                log.warning("second signal: stopping now")
                break
            api.join(0.2)
        return 0

    # ---- stopping ----
    def _stop_all(self) -> None:
        """API first (no new requests), then the scheduler (which stops its own children);
        then make sure no xinfer process that reported to us is left."""
        for name in (API, SCHEDULER):
            p = self.procs.get(name)
            if p is None:
                continue
            if p.is_alive():
                if name == API and self.signals > 1:
                    p.kill()  # a second Ctrl-C: no more waiting for the drain
                else:
                    p.terminate()
                p.join(10)
            if p.is_alive():
                log.warning("%s did not stop; killing it", name)
                p.kill()
            p.join(5)
        deadline = time.monotonic() + 5  # grandchildren notice their parent is gone within ~1 s
        while time.monotonic() < deadline and _ours(self.pids):
            time.sleep(0.1)
        for pid in _ours(self.pids):
            log.warning("process %d did not stop; killing it", pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _ours(pids) -> list[int]:
    """The pids still alive and still xinfer processes (not a recycled pid)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read()
        except OSError:
            continue
        if title.startswith(b"xinfer::") and process.pid_alive(pid):
            out.append(pid)
    return out


def launch(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
           max_queued_requests: int = 256, drain_timeout: float = 30.0, startup_timeout: float = 600.0,
           api_options: dict | None = None) -> int:
    """Run the server until it stops; returns the exit code. `api_options`: the API process's own
    settings (see xinfer.api.app.create_app)."""
    process.set_title("xinfer::launch")
    return Supervisor(config, host, port, log_level, max_queued_requests, drain_timeout, startup_timeout,
                      api_options).run()

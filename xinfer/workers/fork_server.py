"""Where model workers come from: a fork server (xinfer::worker-fork, a child of the scheduler) that
has already imported torch and the model code (xinfer/workers/zygote.py), and has started no thread
and touched no device: a restart after a crash then costs the model load, not two more seconds of
imports. The server exits when the scheduler does; its workers follow it (they watch their parent).
Kept free of torch, so the scheduler can start the server before its own imports."""
from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing import forkserver

_fork_env: dict | None = None  # the environment the fork server started in


def worker_context():
    """Workers see the environment the server started in (modules read XINFER_* as they import):
    once the environment has changed (an offline Engine after a setting), workers are spawned afresh."""
    global _fork_env
    env = dict(os.environ)
    if _fork_env is None:
        _fork_env = env
    if env != _fork_env:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["xinfer.workers.zygote"])
    return ctx


def start() -> None:
    """Start the server now, so its imports run beside the caller's own instead of after them
    (the scheduler's start-up, ~1.5 s less on two cores)."""
    if worker_context().get_start_method() == "forkserver":
        forkserver.ensure_running()

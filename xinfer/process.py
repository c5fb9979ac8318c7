"""Process plumbing shared by every xinfer process: logging, titles, parent watch, liveness,
ready/failed reporting to the supervisor, and run_process(), the wrapper each child runs in.

Imports nothing heavy (no torch, no engine), so the API, detokenizer and parser stay small.
"""
from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import time

import msgspec
import zmq

from xinfer import envs
from xinfer.errors import XinferError
from xinfer.ipc.launch import Failed, LaunchMessage, Started

log = logging.getLogger("xinfer.process")


def setup_logging(level: str = "info", name: str = "xinfer") -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s", datefmt="%H:%M:%S")


def set_title(name: str) -> None:
    """Name the process for ps and top (xinfer::launch, xinfer::api, xinfer::scheduler, ...)."""
    try:
        import setproctitle
        setproctitle.setproctitle(name)
    except ImportError:
        pass


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not registered yet
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def report(msg: LaunchMessage) -> None:
    """Send one message to the supervisor, if there is one (XINFER_LAUNCH). Waits (at most 2 s)
    until the message is handed over, so a process may exit right after reporting its failure.
    Outside xinfer-launch (the offline Engine, tests) this does nothing."""
    addr = envs.launch_address()
    if not addr:
        return
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 2000)
        s.connect(addr)
        s.send(msgspec.msgpack.encode(msg), zmq.NOBLOCK)
        s.close()
    except zmq.ZMQError:
        pass
    finally:
        ctx.term()


_ready = False  # this process has reported Started


def freeze_heap() -> None:
    """What start-up built (a model's modules and weights, a tokenizer, imports) moved out of the
    cyclic collector's sight: its full collections otherwise walked all of it every few hundred steps,
    ~10% of a 64-sequence decode step on the CPU (bench/NOTES-cpu.md)."""
    gc.collect()
    gc.freeze()


def started(name: str, expect: list[str] | None = None) -> None:
    global _ready
    _ready = True
    freeze_heap()
    report(Started(name, os.getpid(), expect or []))


def failed(name: str, message: str) -> None:
    report(Failed(name, os.getpid(), message))


def error_message(e: BaseException) -> str:
    """What the user is shown: our own errors as they are, others with their type."""
    return str(e) if isinstance(e, XinferError) else f"{type(e).__name__}: {e}"


def exit_with_parent(parent: int) -> None:
    """SIGTERM this process once `parent` is gone (even SIGKILLed), also while the main thread
    is busy, e.g. loading a model: no orphan outlives the tree it belonged to."""
    def watch():
        while os.getppid() == parent:
            time.sleep(1)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def run_process(name: str, log_level: str, main, *args, parent: int | None = None) -> None:
    """Run `main(*args)` as the xinfer process `name`: logging and title set, Ctrl-C left to the
    supervisor, SIGTERM unwinding through finally clauses, gone when `parent` is; an exception
    that escapes `main` is logged and reported as Failed (the supervisor shows it), exit code 1.
    `main` reports `started(name)` itself once it is ready."""
    setup_logging(log_level, name)
    set_title(name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if parent is not None:
        exit_with_parent(parent)
    try:
        main(*args)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:
        message = error_message(e)
        if not _ready:  # a bad model or flag: one clear line (the supervisor shows it too)
            log.debug("start-up failed", exc_info=True)
            log.error("could not start: %s", message)
        elif isinstance(e, XinferError):
            log.error("%s", message)
        else:
            log.exception("stopped by an unexpected error")
        failed(name, message)
        raise SystemExit(1) from None


def frame_loop(pull, codec, handle, parent: int) -> None:
    """The loop of a process that only reacts to frames (the detokenizer, the parser): each frame
    that decodes is handed to `handle`; returns once `parent` is gone."""
    while True:
        if not pull.poll(1000):
            if os.getppid() != parent:
                return
            continue
        msg = codec.decode(pull.recv())
        if msg is not None:
            handle(msg)

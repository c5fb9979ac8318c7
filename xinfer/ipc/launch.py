"""Child -> supervisor messages (the xinfer-launch start-up handshake).

The supervisor binds a ZMQ PULL socket in its private runtime directory and puts its
address in the environment (XINFER_LAUNCH) of the processes it starts; every xinfer
process inherits it and reports once when it is ready (Started) or could not start
(Failed, with the error text the supervisor shows). Outside xinfer-launch (the offline
Engine, tests) the variable is unset and reporting does nothing.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import msgspec
import zmq

ENV = "XINFER_LAUNCH"


class Started(msgspec.Struct, array_like=True, tag="started"):
    name: str  # the process title: xinfer::api, xinfer::scheduler, xinfer::worker-0, ...
    pid: int
    expect: list[str] = []  # children this process started, which report for themselves


class Failed(msgspec.Struct, array_like=True, tag="failed"):
    name: str
    pid: int
    message: str


LaunchMessage = Started | Failed


def report(msg: LaunchMessage) -> None:
    """Send one message to the supervisor, if there is one. Waits (at most 2 s) until the
    message is handed over, so a process may exit right after reporting its failure."""
    addr = os.environ.get(ENV)
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


def started(name: str, expect: list[str] | None = None) -> None:
    report(Started(name, os.getpid(), expect or []))


def failed(name: str, message: str) -> None:
    report(Failed(name, os.getpid(), message))


def exit_with_parent(parent: int) -> None:
    """SIGTERM this process once `parent` is gone (even SIGKILLed), also while the main thread
    is busy, e.g. loading a model: no orphan outlives the tree it belonged to."""
    def watch():
        while os.getppid() == parent:
            time.sleep(1)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()

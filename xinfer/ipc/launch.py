"""Child -> supervisor messages (the xinfer-launch start-up handshake).

The supervisor binds a ZMQ PULL socket in its private runtime directory and puts its
address in the environment (XINFER_LAUNCH) of the processes it starts; every xinfer
process inherits it and reports once when it is ready (Started) or could not start
(Failed, with the error text the supervisor shows); xinfer/process.py sends them.
"""
from __future__ import annotations

import msgspec


class Started(msgspec.Struct, array_like=True, tag="started"):
    name: str  # the process title: xinfer::api, xinfer::scheduler, xinfer::worker-0, ...
    pid: int
    expect: list[str] = []  # children this process started, which report for themselves


class Failed(msgspec.Struct, array_like=True, tag="failed"):
    name: str
    pid: int
    message: str


LaunchMessage = Started | Failed

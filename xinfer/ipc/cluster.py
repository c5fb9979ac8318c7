"""Several nodes: node 0's scheduler publishes each worker generation's start and every step plan
over TCP (master_port + 1) to the headless nodes (xinfer/workers/headless.py), which hand the plans
to their workers through the same shared-memory ring as on node 0.

Every frame is a msgspec message followed by its HMAC-SHA256 under --cluster-key: a frame that
does not verify is dropped, never decoded, let alone executed (no pickle). Each frame carries the
publisher's session (random, per start of node 0's scheduler) and a sequence number that only
grows, so an old frame replayed on the wire is dropped too. The key authenticates; it does not
encrypt: the plans (token ids) cross the network in clear, as the activations do over gloo.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time

import msgspec
import zmq

log = logging.getLogger("xinfer.cluster")

BEAT = 1.0  # seconds between heartbeats; a subscriber that hears nothing for LOST takes node 0 as gone
LOST = 10.0
_MAC = 32


class Start(msgspec.Struct, array_like=True, tag="start"):
    """Worker generation `gen` starts: its config (JSON of node 0's EngineConfig) and KV blocks."""
    session: bytes
    seq: int
    gen: int
    config: bytes
    num_blocks: int | None


class Plan(msgspec.Struct, array_like=True, tag="plan"):
    session: bytes
    seq: int
    gen: int
    payload: bytes  # the StepPlan frame, as node 0's ring carries it


class Beat(msgspec.Struct, array_like=True, tag="beat"):
    session: bytes
    seq: int
    gen: int


class Stop(msgspec.Struct, array_like=True, tag="stop"):
    session: bytes
    seq: int
    gen: int


Message = Start | Plan | Beat | Stop


def address(master_addr: str, master_port: int) -> str:
    host = f"[{master_addr}]" if ":" in master_addr else master_addr
    return f"tcp://{host}:{master_port + 1}"


class Publisher:
    """Node 0's end (ProcessRunner): binds master_addr:master_port + 1. A thread sends heartbeats
    while the scheduler is idle, so that headless nodes can tell a quiet node 0 from a dead one."""

    def __init__(self, master_addr: str, master_port: int, key: str | None):
        self._key = (key or "").encode()
        self._session = os.urandom(16)
        self._seq = 0
        self._gen = 0
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # never drop a plan: a lost plan desynchronises the ranks
        self._sock.setsockopt(zmq.LINGER, 0)
        addr = address(master_addr, master_port)
        try:
            self._sock.bind(addr)
        except zmq.ZMQError as e:
            raise OSError(f"cannot listen on {addr} for the other nodes: {e}") from None
        self._enc = msgspec.msgpack.Encoder()
        self._closed = threading.Event()
        self._beats = threading.Thread(target=self._beat, name="xinfer-cluster-beat", daemon=True)
        self._beats.start()

    def _send(self, make, **fields) -> None:
        with self._lock:
            self._seq += 1
            frame = self._enc.encode(make(session=self._session, seq=self._seq, **fields))
            self._sock.send(frame + hmac.new(self._key, frame, hashlib.sha256).digest())

    def start(self, gen: int, config: bytes, num_blocks: int | None) -> None:
        """Sent again and again while the generation starts: a node that joins late still hears it."""
        self._gen = gen
        self._send(Start, gen=gen, config=config, num_blocks=num_blocks)

    def plan(self, gen: int, payload: bytes) -> None:
        self._send(Plan, gen=gen, payload=payload)

    def stop(self, gen: int) -> None:
        self._send(Stop, gen=gen)

    def _beat(self) -> None:
        while not self._closed.wait(BEAT):
            self._send(Beat, gen=self._gen)

    def close(self) -> None:
        self._closed.set()
        self._beats.join(2)
        with self._lock:
            self._sock.close()
        self._ctx.term()


class Subscriber:
    """A headless node's end: connects to node 0 and yields the messages that verify, in order."""

    def __init__(self, master_addr: str, master_port: int, key: str | None):
        self._key = (key or "").encode()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(address(master_addr, master_port))
        self._dec = msgspec.msgpack.Decoder(Message)
        self._session, self._seq = None, 0
        self.heard = time.monotonic()
        self.rejected = 0

    def recv(self, timeout: float) -> Message | None:
        """The next message that verifies, or None after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not self._sock.poll(int(left * 1000) + 1):
                return None
            msg = self.verify(self._sock.recv())
            if msg is not None:
                self.heard = time.monotonic()
                return msg
        return None

    def verify(self, frame: bytes) -> Message | None:
        body, mac = frame[:-_MAC], frame[-_MAC:]
        if len(frame) <= _MAC or not hmac.compare_digest(mac, hmac.new(self._key, body, hashlib.sha256).digest()):
            return self._reject("its signature does not verify (a different --cluster-key?)")
        try:
            msg = self._dec.decode(body)
        except msgspec.DecodeError:
            return self._reject("it does not decode")
        if msg.session != self._session:
            if not isinstance(msg, Start):
                return None  # the middle of a session we did not see start: wait for its Start
            self._session, self._seq = msg.session, 0
        if msg.seq <= self._seq:
            return self._reject("it is a replay")
        self._seq = msg.seq
        return msg

    def _reject(self, why: str):
        self.rejected += 1
        if self.rejected in (1, 10, 100) or self.rejected % 1000 == 0:
            log.warning("dropped a frame from node 0's address: %s (%d dropped so far)", why, self.rejected)
        return None

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()

"""A shared-memory ring buffer: one writer, n readers, fixed-size slots.

Layout (all little-endian):
  header:   magic u32 | num_slots u32 | slot_size u32 | num_readers u32 | shutdown u32 | pad u32
            | writer_pid u64 | reader_pid u64 * num_readers
  slot i:   seq u64 | length u32 | overflow u32 | read flag u8 * num_readers (padded to 8) | payload

The writer fills slot (n % num_slots) with message n, then publishes it by storing
seq = n + 1 last. A reader waiting for message n polls that slot's seq; after copying the
payload it sets its own read flag. The writer reuses a slot only once every reader has
flagged it. The seq store is the fence: x86-64 keeps stores in program order and loads in
program order (TSO), and CPython performs each memoryview store as one machine store, so
a reader that sees the new seq also sees the payload written before it.

A payload larger than a slot goes through a ZMQ side channel (one PUSH/PULL pair per
reader); its slot carries only an overflow mark, so order is kept.

A reader waits by spinning briefly, then blocking in futex_wait on the slot's seq word, which
the writer wakes right after publishing (Linux; elsewhere it sleeps with a growing back-off). A
blocked reader costs no CPU and wakes within microseconds: on a 2-core machine a polling reader
either steals time from the model worker's threads or wakes late. Every wait checks the peer's
liveness and the shutdown flag at least every 50 ms, so nothing hangs on a dead process.
"""
from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys
import time
from multiprocessing import shared_memory

import zmq

from xinfer.process import pid_alive

MAGIC = 0x58524E47  # "XRNG"
_HDR = struct.Struct("<IIIIII Q")
_SLOT = struct.Struct("<QII")


_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine()) if sys.platform.startswith("linux") else None
_libc = ctypes.CDLL(None, use_errno=True) if _SYS_FUTEX else None
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not PRIVATE): the word lives in memory mapped by several processes


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


def _futex_wait(addr: int, expected: int, timeout: float) -> None:
    """Block while the u32 at addr equals `expected`, up to `timeout` s (or until a wake)."""
    ts = _Timespec(int(timeout), int((timeout % 1) * 1e9))
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_uint32(expected), ctypes.byref(ts),
                  None, 0)


def _futex_wake(addr: int) -> None:
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


class PeerDied(RuntimeError):
    pass


class RingClosed(RuntimeError):
    pass


class _Ring:
    def __init__(self, shm: shared_memory.SharedMemory):
        self.shm = shm
        self.buf = shm.buf
        magic, self.num_slots, self.slot_size, self.num_readers, _, _, _ = _HDR.unpack_from(self.buf, 0)
        if magic != MAGIC:
            raise ValueError(f"shared memory {shm.name} is not an xinfer ring")
        self.hdr_size = _align(_HDR.size + 8 * self.num_readers)
        self.flags_size = _align(self.num_readers)
        self.payload_size = self.slot_size - _SLOT.size - self.flags_size
        self.base = None
        if _SYS_FUTEX:
            view = ctypes.c_char.from_buffer(self.buf)
            self.base = ctypes.addressof(view)
            del view  # the address stays valid while the segment is mapped; no export kept

    @property
    def name(self) -> str:
        return self.shm.name

    def _slot(self, i: int) -> int:
        return self.hdr_size + (i % self.num_slots) * self.slot_size

    def _pid(self, k: int) -> int:  # k = -1: writer, else reader k
        return struct.unpack_from("<Q", self.buf, _HDR.size - 8 + 8 * (k + 1))[0]

    def _set_pid(self, k: int) -> None:
        struct.pack_into("<Q", self.buf, _HDR.size - 8 + 8 * (k + 1), os.getpid())

    def shutdown(self) -> None:
        struct.pack_into("<I", self.buf, 16, 1)

    @property
    def is_shutdown(self) -> bool:
        return struct.unpack_from("<I", self.buf, 16)[0] == 1

    def close(self) -> None:
        self.buf = None
        try:
            self.shm.close()
        except BufferError:
            pass


def _align(n: int) -> int:
    return (n + 7) & ~7


def _wait(ready, peers, ring: _Ring, what: str, timeout: float | None, word: int | None = None):
    """Spin, then block on the futex at buffer offset `word` (or sleep with back-off), until ready();
    watch peers and the shutdown flag."""
    for _ in range(200):
        if ready():
            return
    sleep, start = 20e-6, time.monotonic()
    checked = start  # peers are checked from 50 ms on: a step's wait would pay for it every time
    use_futex = word is not None and ring.base is not None
    while True:
        seen = struct.unpack_from("<I", ring.buf, word)[0] if use_futex else 0
        if ready():
            return
        now = time.monotonic()
        if now - checked > 0.05:
            checked = now
            if ring.is_shutdown:
                raise RingClosed(f"ring {ring.name} shut down while waiting to {what}")
            for pid in peers():
                if not pid_alive(pid):
                    raise PeerDied(f"process {pid} died while this one waited to {what}")
        if timeout is not None and now - start > timeout:
            raise TimeoutError(f"timed out waiting to {what}")
        if use_futex:  # a publish between reading `seen` and this call makes it return at once
            _futex_wait(ring.base + word, seen, 0.05 if timeout is None else max(0.0, min(0.05, start + timeout - now)))
        else:
            time.sleep(sleep)
            sleep = min(sleep * 2, 2e-3)


def create_ring(num_readers: int, num_slots: int = 16, slot_size: int = 1 << 16,
                name: str | None = None) -> shared_memory.SharedMemory:
    """Create and initialise a ring segment. The caller owns it: it unlinks the segment
    (`.close(); .unlink()`) when both sides are done; writer and readers attach by name.
    Processes spawned by multiprocessing share the creator's resource tracker, which
    unlinks the segment if the whole process tree dies without doing so."""
    hdr = _align(_HDR.size + 8 * num_readers)
    size = hdr + num_slots * slot_size
    shm = shared_memory.SharedMemory(name=name, create=True, size=size)
    shm.buf[:size] = bytes(size)
    _HDR.pack_into(shm.buf, 0, MAGIC, num_slots, slot_size, num_readers, 0, 0, 0)
    ring = _Ring(shm)
    assert ring.payload_size > 0, "slot_size too small"
    # Every slot starts out "read by all", so the writer's first lap never waits.
    for i in range(num_slots):
        o = ring._slot(i) + _SLOT.size
        shm.buf[o:o + num_readers] = b"\x01" * num_readers
    ring.buf = None
    return shm


class RingWriter(_Ring):
    """The one writer of a ring. `side_endpoints[k]` is reader k's overflow channel (bound here)."""

    def __init__(self, name: str, side_endpoints: list[str] | None = None, zmq_ctx: zmq.Context | None = None):
        super().__init__(shared_memory.SharedMemory(name=name))
        self._set_pid(-1)
        self.seq = 0
        self.side = []
        ctx = zmq_ctx or zmq.Context.instance()
        for ep in side_endpoints or []:
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.bind(ep)
            self.side.append(s)

    def write(self, payload: bytes, timeout: float | None = None) -> None:
        off = self._slot(self.seq)
        flags = off + _SLOT.size
        n = self.num_readers
        _wait(lambda: self.buf[flags:flags + n] == b"\x01" * n,
              lambda: [self._pid(k) for k in range(n)], self, "write", timeout)
        big = len(payload) > self.payload_size
        if big:
            if not self.side:
                raise ValueError(f"message of {len(payload)} bytes exceeds the ring's {self.payload_size}-byte "
                                 "slots and the ring has no side channel")
            for s in self.side:
                s.send(payload)
        else:
            start = flags + self.flags_size
            self.buf[start:start + len(payload)] = payload
        self.buf[flags:flags + n] = bytes(n)
        struct.pack_into("<II", self.buf, off + 8, len(payload), 1 if big else 0)
        struct.pack_into("<Q", self.buf, off, self.seq + 1)  # publish: the last store
        if self.base is not None:
            _futex_wake(self.base + off)
        self.seq += 1


class RingReader(_Ring):
    def __init__(self, name: str, index: int, side_endpoint: str | None = None,
                 zmq_ctx: zmq.Context | None = None):
        super().__init__(shared_memory.SharedMemory(name=name))
        self.index = index
        self.seq = 0
        self._set_pid(index)
        self.side = None
        if side_endpoint:
            ctx = zmq_ctx or zmq.Context.instance()
            self.side = ctx.socket(zmq.PULL)
            self.side.setsockopt(zmq.LINGER, 0)
            self.side.connect(side_endpoint)

    def poll(self) -> bool:
        return struct.unpack_from("<Q", self.buf, self._slot(self.seq))[0] == self.seq + 1

    def read(self, timeout: float | None = None) -> bytes:
        off = self._slot(self.seq)
        _wait(self.poll, lambda: [self._pid(-1)], self, "read", timeout, word=off)
        length, big = struct.unpack_from("<II", self.buf, off + 8)
        flags = off + _SLOT.size
        if big:
            payload = self.side.recv()
        else:
            start = flags + self.flags_size
            payload = bytes(self.buf[start:start + length])
        self.buf[flags + self.index] = 1  # done with this slot
        self.seq += 1
        return payload

"""The shared-memory ring on its own: order, wrap-around, overflow, many readers, dead peers."""
import multiprocessing as mp
import os
import signal
import struct
import time

import pytest

from xinfer.ipc.channels import endpoint, runtime_dir
from xinfer.ipc.shm_ring import PeerDied, RingClosed, RingReader, RingWriter, create_ring

CTX = mp.get_context("spawn")


def _reader(name, index, side, n, q):
    r = RingReader(name, index, side)
    total, expect = 0, 0
    for _ in range(n):
        msg = r.read(timeout=60)
        k = struct.unpack_from("<Q", msg)[0]
        if k != expect or len(msg) != 8 + (k % 7) * (3000 if k % 1000 == 999 else 1):
            q.put(("bad", k, expect, len(msg)))
            return
        expect += 1
        total += k
    q.put(("ok", expect, total))
    r.close()


def _msg(k, big_every=1000):
    extra = (k % 7) * (3000 if k % big_every == big_every - 1 else 1)
    return struct.pack("<Q", k) + b"x" * extra


@pytest.mark.parametrize("readers, n", [(1, 1_000_000), (3, 5_000)])
def test_order_wraparound_overflow_no_loss(readers, n):
    d = runtime_dir()
    sides = [endpoint(d, f"side{i}") for i in range(readers)]
    shm = create_ring(readers, num_slots=8, slot_size=1024)
    w = RingWriter(shm.name, side_endpoints=sides)
    q = CTX.Queue()
    procs = [CTX.Process(target=_reader, args=(w.name, i, sides[i], n, q)) for i in range(readers)]
    for p in procs:
        p.start()
    for k in range(n):  # a 2-4 KB message every 1000th overflows the 1 KB slots
        w.write(_msg(k), timeout=60)
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(10)
    w.close()
    shm.unlink()
    assert results == [("ok", n, n * (n - 1) // 2)] * readers


def _die_after(name, index, k):
    r = RingReader(name, index)
    for _ in range(k):
        r.read(timeout=10)
    os.kill(os.getpid(), signal.SIGKILL)


def test_writer_notices_a_dead_reader():
    shm = create_ring(2, num_slots=4, slot_size=256)
    w = RingWriter(shm.name)
    p = CTX.Process(target=_die_after, args=(w.name, 1, 2))
    p.start()
    other = RingReader(w.name, 0)
    with pytest.raises(PeerDied):
        for k in range(100):
            w.write(b"m%d" % k, timeout=30)
            if k < 4:
                other.read()
    p.join()
    other.close()
    w.close()
    shm.unlink()


def _write_then_die(name, k):
    w = RingWriter(name)
    for i in range(k):
        w.write(b"%d" % i)
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)


def test_reader_notices_a_dead_writer():
    shm = create_ring(1, num_slots=4, slot_size=256)
    r = RingReader(shm.name, 0)
    p = CTX.Process(target=_write_then_die, args=(shm.name, 3))
    p.start()
    assert [r.read(timeout=10) for _ in range(3)] == [b"0", b"1", b"2"]
    t = time.monotonic()
    with pytest.raises(PeerDied):
        r.read(timeout=30)
    assert time.monotonic() - t < 5
    p.join()
    r.close()
    shm.unlink()


def test_shutdown_flag_wakes_a_reader():
    shm = create_ring(1, num_slots=2, slot_size=128)
    w, r = RingWriter(shm.name), RingReader(shm.name, 0)
    w.shutdown()
    with pytest.raises(RingClosed):
        r.read(timeout=5)
    r.close()
    w.close()
    shm.unlink()


def test_idle_wait_uses_little_cpu():
    shm = create_ring(1, num_slots=2, slot_size=128)
    w, r = RingWriter(shm.name), RingReader(shm.name, 0)
    t0, c0 = time.monotonic(), time.process_time()
    with pytest.raises(TimeoutError):
        r.read(timeout=1.0)
    assert (time.process_time() - c0) / (time.monotonic() - t0) < 0.1
    r.close()
    w.close()
    shm.unlink()

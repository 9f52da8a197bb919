"""Control rings in shared memory (sdp.transport.shm_ctrl), two "ranks" in one process: two real
memfd segments mapped through /proc, real pipes as doorbells; ZeroMQ stood in for by a deque."""
import collections
import os
import random
import sys
import threading
import time

import pytest

from sdp.transport import shm, shm_ctrl

pytestmark = pytest.mark.skipif(not (shm_ctrl.usable(2) and shm.available()),
                                reason="control rings need x86-64 Linux with /proc")


class _Frame:
    def __init__(self, body):
        self.bytes = body


@pytest.fixture
def pair():
    segs = [shm.SharedSegments(f"t{os.getpid()}", r, 4096, 0, rings=2) for r in (0, 1)]
    segs[0].attach(1, segs[1].path)
    segs[1].attach(0, segs[0].path)
    pipes = [os.pipe() for _ in (0, 1)]  # rank r's doorbell: pipes[r]
    for r, w in pipes:
        os.set_blocking(r, False)
    rings = [shm_ctrl.ControlRings(segs[r], r, {1 - r: shm_ctrl.open_bell(shm_ctrl.bell_path(pipes[1 - r][1]))})
             for r in (0, 1)]
    for c in rings:
        c.start()
    for c in rings:
        c.ready()
    yield rings, pipes
    for c in rings:
        c.close()
    for seg in segs:
        seg.unlink()
    for fds in pipes:
        for fd in fds:
            os.close(fd)


def test_messages_arrive_in_order_across_wraps_and_zeromq_fallbacks(pair):
    """Random sizes (most small, some over half the ring: those go "over ZeroMQ"), sent in bursts
    that fill the ring (then messages go over ZeroMQ until the receiver reads): every body
    arrives once, in the order sent, and the doorbell rang."""
    (a, b), pipes = pair
    assert a.senders == {1: True} and b.senders == {0: True}
    rng = random.Random(5)
    box = collections.deque()  # ZeroMQ's control inbox of rank 1, from rank 0
    sent, got, over = [], [], 0
    for burst in range(200):
        for _ in range(rng.randint(1, 40)):
            n = rng.choice([1, 7, 8, 100, 3000, 20000, shm_ctrl.RING_BYTES // 2 + 1])
            body = os.urandom(n)
            k = a.send(1, body)
            if k is not None:
                box.append((0, k, [_Frame(body)]))
                over += 1
            sent.append(body)
        if burst % 3 == 0 and box:  # ZeroMQ's messages arrive late, out of step with the ring
            late = box.pop()
            got += b.recv(0, box)
            box.append(late)
        got += b.recv(0, box)
    got += b.recv(0, box)
    assert got == sent and not box
    assert over > 0 and a._wpos[1] > 3 * shm_ctrl.RING_BYTES  # fell back, and wrapped several times
    assert os.read(pipes[1][0], 1 << 20)  # rank 1's doorbell rang
    with pytest.raises(BlockingIOError):
        os.read(pipes[0][0], 1)  # rank 0's did not: nothing was sent to it


def test_both_directions_at_once_never_block(pair):
    """Two ranks sending to each other with full rings: neither waits (the rest goes over ZeroMQ)."""
    (a, b), _ = pair
    boxes = {0: collections.deque(), 1: collections.deque()}
    body = b"x" * 1000
    for i in range(500):
        for c, dst in ((a, 1), (b, 0)):
            k = c.send(dst, body + str(i).encode())
            if k is not None:
                boxes[dst].append((0, k, [_Frame(body + str(i).encode())]))
    want = [body + str(i).encode() for i in range(500)]
    assert b.recv(0, boxes[1]) == want and a.recv(1, boxes[0]) == want


def test_segment_layout_keeps_the_pool_and_flags_clear_of_the_rings():
    seg = shm.SharedSegments(f"t{os.getpid()}", 0, 4096, 8192, rings=3)
    try:
        assert seg.nbytes == 2 * 4096 + 8192 + 3 * shm_ctrl.RING_BYTES + shm_ctrl.LANE_BYTES + shm.FLAGS_BYTES
        # halves, pool, rings, the fast lane's region, flags
        assert seg.ring_offset(0) == 2 * 4096 + 8192 and seg.ring_offset(2) + shm_ctrl.RING_BYTES == \
            seg.lane_offset() and seg.lane_offset() + shm_ctrl.LANE_BYTES == seg.nbytes - shm.FLAGS_BYTES
        off, arr = seg.pool.alloc("uint8", 8192)
        assert seg.pool_offset(arr) == off and off + 8192 <= seg.ring_offset(0)
    finally:
        seg.unlink()


def test_a_ring_racing_the_close_never_writes_to_a_reused_descriptor(pair):
    """The fast lane rings from callers' threads while the engine thread may close the doorbells.
    A thread rings as fast as it can while the main thread closes them and at once dup()s a probe
    pipe's write end (the lowest free number: the doorbell's, just closed): no byte ever reaches
    the probe, and no ring fails.  (With the number read outside the close's lock, here a byte
    reached the probe in about one round in three.)"""
    segs = [c.seg for c in pair[0]]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (thread switches between any two bytecodes, as on a busy host)
    stray, failed, rounds = 0, [], 0
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline and rounds < 300:
            rounds += 1
            r, w = os.pipe()
            ctrl = shm_ctrl.ControlRings(segs[0], 0, {1: shm_ctrl.open_bell(shm_ctrl.bell_path(w))})
            probe_r, probe_w = os.pipe()
            os.set_blocking(probe_r, False)
            stop, rang = threading.Event(), [0]

            def ringer():
                try:
                    while not stop.is_set():
                        ctrl.ring(1)
                        rang[0] += 1
                except OSError as e:
                    failed.append(e)

            def rings_after(n):  # (waits for the ringer, not for a fixed time)
                end = time.monotonic() + 5
                while rang[0] <= n and t.is_alive() and time.monotonic() < end:
                    time.sleep(0)

            t = threading.Thread(target=ringer)
            t.start()
            rings_after(0)  # ringing when the close comes
            ctrl.close()
            reused = os.dup(probe_w)
            rings_after(rang[0] + 1)  # and on after the number is reused
            stop.set()
            t.join()
            try:
                stray += bool(os.read(probe_r, 64))
            except BlockingIOError:
                pass
            for fd in (probe_r, probe_w, reused, r, w):
                os.close(fd)
    finally:
        sys.setswitchinterval(switch)
    assert (stray, failed) == (0, []), f"{stray} stray bytes, {len(failed)} failed rings in {rounds} rounds"


def test_a_ring_after_close_writes_to_no_descriptor(pair):
    # (the fast lane rings through the same object from callers' threads: after close it must
    # find no descriptor number to write a byte to, since a closed number soon names another
    # file of the process)
    rings, _ = pair
    fd = rings[0].bells[1]
    rings[0].close()
    assert rings[0].bells == {}
    with pytest.raises(OSError):
        os.fstat(fd)
    r, w = os.pipe()  # (the lowest free numbers: the doorbell's, or lower)
    try:
        os.set_blocking(r, False)
        for q in (0, 1):
            rings[0].ring(q)
        with pytest.raises(BlockingIOError):
            os.read(r, 8)
    finally:
        os.close(r)
        os.close(w)

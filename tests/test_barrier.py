"""Shared-memory flag barriers between two segments of one process (real /dev/shm mappings; the
mesh is a stand-in with only what the barrier reads: rank, size, shm, timeout and loss state)."""
import os
import time

import pytest

from sdp.common.errors import CollectiveTimeoutError, PeerLostError
from sdp.engine import barrier
from sdp.transport import shm

pytestmark = pytest.mark.skipif(not (shm.available() and barrier.FLAGS_ORDERED),
                                reason="flag barriers need /dev/shm and x86-64")


class Side:
    """One rank's view: its own segment plus the peer's, mapped from the peer's file."""

    def __init__(self, rank, segs, timeout_s=0.3):
        self.rank, self.size, self.timeout_s = rank, 2, timeout_s
        self.shm, self.lost, self.stopping = segs[rank], {}, False

    def pump(self, timeout_ms):
        pass

    def peer_error(self):
        return PeerLostError(min(self.lost), self.lost[min(self.lost)])


@pytest.fixture
def sides():
    job = f"test{os.getpid()}"
    segs = [shm.SharedSegments(job, r, 4096) for r in range(2)]
    for r in range(2):
        segs[r].attach(1 - r, segs[1 - r].path)
    yield [Side(r, segs) for r in range(2)]
    for s in segs:
        s.unlink()


def test_values_are_exchanged_and_counts_keep_pace(sides):
    a, b = sides
    for k in range(6):  # more rounds than value slots
        ta = barrier.post(a, k, 0, 100 + k)
        tb = barrier.post(b, k, 0, 200 + k)
        assert barrier.wait(a, ta) == [100 + k, 200 + k] == barrier.wait(b, tb)
    ta, tb = barrier.post(a, 9, 1), barrier.post(b, 9, 1)  # no values
    assert barrier.wait(a, ta) is None and barrier.wait(b, tb) is None


def test_two_posts_ahead_then_waits_in_order(sides):
    """allreduce_staged posts all parts before waiting on the first."""
    a, b = sides
    ta = [barrier.post(a, 1, j, 10 + j) for j in range(2)]
    tb = [barrier.post(b, 1, j, 20 + j) for j in range(2)]
    assert [barrier.wait(a, t) for t in ta] == [[10, 20], [11, 21]]
    assert [barrier.wait(b, t) for t in tb] == [[10, 20], [11, 21]]


def test_missing_peer_times_out_naming_it(sides):
    a, _ = sides
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=r"ranks \[1\] did not reach barrier 1 within 0.3 s"):
        barrier.sync(a, 1, 0)
    assert time.monotonic() - t0 < 2


def test_lost_peer_raises_peer_lost(sides):
    a, _ = sides
    a.lost[1] = "connection closed (process died?)"
    with pytest.raises(PeerLostError, match="lost connection to rank 1"):
        barrier.sync(a, 1, 0)

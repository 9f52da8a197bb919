"""What a submitted collective's caller holds: ``Handle`` (one collective), ``PartHandle``
(one array of a flattened group, or of a burst the fast lane gathered into one batch) and
``DoneHandle`` (a collective done in the caller's thread).  ``wait()`` returns the result
array or raises the error every rank sees; ``done()`` never blocks."""
import threading
import time
from typing import Optional

from sdp.common import errors


class Handle:
    """The pending result of one submitted collective."""

    __slots__ = ("name", "_lock", "_is_done", "_result", "_error", "_lane", "_waited")

    def __init__(self, name: str):
        self.name = name
        # held until the result is set: a bare lock is ~20x cheaper to make than an Event, and
        # a gradient list makes one handle per tensor per step
        self._lock = threading.Lock()
        self._lock.acquire()
        self._is_done = False
        self._result = None
        self._error: Optional[BaseException] = None
        self._lane = None  # the sdp.engine.lane.Lane holding this collective, if one does
        self._waited = False  # wait() was called (the lane learns which submissions start a burst)

    def _set(self, result=None, error=None):
        if self._is_done:
            return
        self._result, self._error = result, error
        self._is_done = True
        try:
            self._lock.release()
        except RuntimeError:  # a racing second _set (shutdown failing what just completed)
            pass

    def done(self) -> bool:
        """True once the result (or error) is available; never blocks (a collective in the fast
        lane is moved on once if no other thread is running the lane)."""
        self._waited = True
        lane = self._lane
        if lane is not None and not self._is_done:
            lane.poll(self)
        return self._is_done

    def wait(self, timeout: Optional[float] = None, _spin: bool = True):
        """Block until done and return the result (numpy array, or tuple for alltoall).

        Raises the collective's error (e.g. ``TensorMismatchError``, ``PeerLostError``),
        or ``CollectiveTimeoutError`` if ``timeout`` seconds pass first.  (``_spin``: False
        when the fast lane has just polled for it.)"""
        self._waited = True
        lane = self._lane
        waits = lane is not None and not self._is_done and lane.drive(self, _spin)  # (the fast lane runs here first)
        if not self._is_done:
            try:
                if not self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
                    raise errors.CollectiveTimeoutError(f"'{self.name}' did not complete within {timeout} s")
            finally:
                if waits:
                    lane.unwait()
            self._lock.release()  # let other waiters of this handle through too
        elif waits:
            lane.unwait()
        if self._error is not None:
            raise self._error
        return self._result


class DoneHandle:
    """The handle of a collective already done in the caller's thread (the fast lane's
    synchronous path): ``wait()`` returns its result."""

    __slots__ = ("_result",)

    def __init__(self, result):
        self._result = result

    def done(self) -> bool:
        return True

    def wait(self, timeout: Optional[float] = None):
        return self._result


class PartHandle:
    """The handle of one array of a flattened group (``Request.group``), or of one
    ``allreduce_async`` of a burst the fast lane gathered into one batch (``sdp.engine.lane``):
    ``wait()`` returns its part of the group's result (a view, no copy); the group's error is
    every part's error.  A batch the lane hands to the engine instead (its ranks gathered
    differently) gives each part the handle of its own request there: ``wait()`` waits on that."""

    __slots__ = ("name", "_group", "_index")

    def __init__(self, name: str, group: Handle, index: int):  # (cc/lane_learn.c sets these slots itself,
        self.name, self._group, self._index = name, group, index  # without a call: keep it to that)

    def done(self) -> bool:
        """True once the group's result (or error) is available; never blocks."""
        group = self._group
        if not group.done():
            return False
        part = group._result[self._index] if group._error is None else None
        return type(part) is not Handle or part.done()

    def wait(self, timeout: Optional[float] = None):
        """Block until the group is done and return this tensor's result (see ``Handle.wait``)."""
        group = self._group
        if group._is_done and group._error is None:  # (done, often by another part: ~0.1 us, not ~0.5)
            group._waited = True  # (for the fast lane: not a burst's first request)
            part = group._result[self._index]
        else:
            end = None if timeout is None else time.monotonic() + timeout
            part = group.wait(timeout)[self._index]
            timeout = None if end is None else max(end - time.monotonic(), 0.0)
        if type(part) is Handle:  # (a burst's part the engine runs)
            return part.wait(timeout)
        return part

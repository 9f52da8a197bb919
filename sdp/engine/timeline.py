"""Chrome-trace timeline of each tensor's phases, viewable in Perfetto / chrome://tracing.

Enabled with ``SDP_TIMELINE=path.json`` (rank 0 writes ``path.json``; other ranks write
``path.json.rank<N>`` only if ``SDP_TIMELINE_ALL_RANKS=1``) or ``start_timeline(path)``.
Each tensor name is one row (``tid``); its phases are duration events: ``NEGOTIATE`` (submitted
until every rank agreed), ``QUEUE`` (agreed, waiting for the collectives scheduled before it),
``FUSE`` (packing into the fusion buffer), ``ALLREDUCE`` / ``BROADCAST`` / ... (communication),
``UNPACK`` (copying results out).  Timestamps are
microseconds since the timeline started.  Written only by the engine thread.
"""
import contextlib
import json
import threading
import time
from typing import Dict, Iterable


class Timeline:
    """An open timeline file; ``close()`` finishes the JSON array."""

    def __init__(self, path: str, rank: int):
        self.path = path
        self._f = open(path, "w", buffering=1 << 20)
        self._f.write("[\n")
        self._t0 = time.perf_counter()
        self._rows: Dict[str, int] = {}
        self._rank = rank
        self._lock = threading.Lock()
        self._first = True

    def _emit(self, ev: dict) -> None:
        with self._lock:
            if self._f.closed:
                return
            self._f.write(("" if self._first else ",\n") + json.dumps(ev, separators=(",", ":")))
            self._first = False

    def _row(self, name: str) -> int:
        tid = self._rows.get(name)
        if tid is None:
            tid = self._rows[name] = len(self._rows) + 1
            self._emit({"name": "thread_name", "ph": "M", "pid": self._rank, "tid": tid, "args": {"name": name}})
        return tid

    def _now_us(self) -> float:
        return (time.perf_counter() - self._t0) * 1e6

    def begin(self, name: str, phase: str) -> None:
        self._emit({"name": phase, "ph": "B", "ts": self._now_us(), "pid": self._rank, "tid": self._row(name)})

    def end(self, name: str, phase: str) -> None:
        self._emit({"name": phase, "ph": "E", "ts": self._now_us(), "pid": self._rank, "tid": self._row(name)})

    @contextlib.contextmanager
    def span(self, names: Iterable[str], phase: str):
        names = list(names)
        for n in names:
            self.begin(n, phase)
        try:
            yield
        finally:
            for n in names:
                self.end(n, phase)

    def close(self) -> None:
        with self._lock:
            if not self._f.closed:
                self._f.write("\n]\n")
                self._f.close()


@contextlib.contextmanager
def span(timeline, names, phase):
    """``timeline.span(...)`` when a timeline is active, else nothing."""
    if timeline is None:
        yield
    else:
        with timeline.span(names, phase):
            yield


def start(runtime, path: str) -> None:
    """Start writing ``runtime``'s timeline to ``path`` (rank 0) — see the module docstring."""
    import os
    rank = runtime.rank
    if rank != 0:
        if os.environ.get("SDP_TIMELINE_ALL_RANKS") != "1":
            return
        path = f"{path}.rank{rank}"
    stop(runtime)
    runtime.timeline = Timeline(path, rank)
    if runtime.lane is not None:
        runtime.lane.enabled = False  # (the timeline shows the engine's phases; the lane has none)


def stop(runtime) -> None:
    """Finish and close ``runtime``'s timeline, if any."""
    tl, runtime.timeline = runtime.timeline, None
    if runtime.lane is not None:
        runtime.lane.enabled = True
    if tl is not None:
        tl.close()

"""Worker processes of ``sdprun``: start them, prefix their output, watch them, stop them.

Each worker runs in its own session (``start_new_session=True``), so ``os.killpg(pid, sig)``
reaches the worker and everything it started.  Stopping means: the signal (SIGTERM by default)
to every worker's process group, then SIGKILL to the groups still alive after a grace period.
"""
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO, List, Mapping, Optional, Sequence

log = logging.getLogger("sdp.launcher")

DEFAULT_GRACE_S = 3.0
_POLL_S = 0.05
_MAX_LINE = 1 << 16  # bytes; a longer line without newline is emitted in pieces


def exit_code(returncode: int) -> int:
    """Shell-style exit status of a ``Popen.returncode``: a process killed by signal S → 128+S."""
    return 128 - returncode if returncode < 0 else returncode


def _live_groups(pgids) -> set:
    """The process groups among ``pgids`` that still have a member that is not a zombie.

    Zombies are ignored: a worker's orphaned children are reaped by init, which may take a while
    (over a second in some containers), and a zombie can no longer do anything."""
    pgids = set(pgids)
    exists = set()
    for pgid in pgids:
        try:
            os.killpg(pgid, 0)
            exists.add(pgid)
        except (ProcessLookupError, PermissionError):
            pass
    if not exists or not os.path.isdir("/proc"):
        return exists
    live = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
            state, _ppid, pgrp = stat[stat.rindex(b")") + 2:].split()[:3]
        except (OSError, ValueError):
            continue  # exited meanwhile
        if state != b"Z" and int(pgrp) in exists:
            live.add(int(pgrp))
    return live


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_launcher() -> None:
    """In the child before exec: get SIGTERM if sdprun dies (even by SIGKILL), so no worker is
    orphaned."""
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _Sink:
    """A text stream shared by the output pumps: whole lines under one lock; survives a
    closed pipe (``sdprun ... | head``) and characters the stream's encoding cannot hold."""

    def __init__(self, stream: IO[str], lock: threading.Lock):
        self.stream = stream
        self.lock = lock
        self.broken = False

    def write(self, text: str) -> None:
        with self.lock:
            if self.broken:
                return
            try:
                try:
                    self.stream.write(text)
                except UnicodeEncodeError:
                    enc = getattr(self.stream, "encoding", None) or "ascii"
                    self.stream.write(text.encode(enc, errors="replace").decode(enc))
                self.stream.flush()
            except (BrokenPipeError, ValueError, OSError):
                self.broken = True  # keep draining the worker's pipe, drop the text


def _pump(pipe: IO[bytes], prefix: str, sink: _Sink) -> None:
    """Copy ``pipe`` to ``sink`` line by line, each line starting with ``prefix``."""
    with pipe:
        for raw in iter(lambda: pipe.readline(_MAX_LINE), b""):
            text = raw.decode("utf-8", errors="replace")
            if not text.endswith("\n"):
                text += "\n"
            sink.write(prefix + text)


class Worker:
    """One started worker: its rank, ``subprocess.Popen`` and output pump threads."""

    def __init__(self, rank: int, proc: subprocess.Popen, pumps: List[threading.Thread]):
        self.rank = rank
        self.proc = proc
        self.pumps = pumps

    @property
    def pid(self) -> int:
        """Process id, which is also the worker's process-group id."""
        return self.proc.pid


class WorkerGroup:
    """Start ``command`` once per environment in ``envs`` (rank = index) and supervise them.

    ``stdout``/``stderr`` (default: the launcher's) receive the workers' lines prefixed with
    ``[rank]<stdout>:`` / ``[rank]<stderr>:`` (no prefix when ``prefix`` is false).  Rank 0
    inherits the launcher's stdin; the other ranks read from ``/dev/null``.
    """

    def __init__(self, command: Sequence[str], envs: Sequence[Mapping[str, str]],
                 stdout: Optional[IO[str]] = None, stderr: Optional[IO[str]] = None,
                 prefix: bool = True, grace_s: float = DEFAULT_GRACE_S):
        self.command = list(command)
        self.envs = list(envs)
        self.prefix = prefix
        self.grace_s = grace_s
        lock = threading.Lock()
        self._out = _Sink(stdout if stdout is not None else sys.stdout, lock)
        self._err = _Sink(stderr if stderr is not None else sys.stderr, lock)
        self.workers: List[Worker] = []
        self._wakeup = threading.Event()
        self._stop_signal: Optional[int] = None
        self._stopping = False
        self._add_lock = threading.Lock()

    def start(self) -> "WorkerGroup":
        """Start all workers.  Raises ``OSError`` (e.g. ``FileNotFoundError`` for an unknown
        command) after stopping the workers already started."""
        try:
            for rank, env in enumerate(self.envs):
                self.workers.append(self._start_one(rank, env))
        except BaseException:
            self.stop(signal.SIGKILL, grace_s=0)
            raise
        log.debug("started %d workers: pids %s", len(self.workers), [w.pid for w in self.workers])
        return self

    def _start_one(self, rank: int, env: Mapping[str, str]) -> Worker:
        # Linux delivers PDEATHSIG when the *thread* that forked exits, so only the main thread's
        # workers get it (elastic workers started from a server thread rely on the engine
        # noticing its peers instead).
        main = threading.current_thread() is threading.main_thread()
        proc = subprocess.Popen(self.command, env=dict(env), start_new_session=True,
                                stdin=None if rank == 0 else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=_die_with_launcher if main and _PRCTL else None)
        pumps = []
        for pipe, tag, sink in ((proc.stdout, "stdout", self._out), (proc.stderr, "stderr", self._err)):
            prefix = f"[{rank}]<{tag}>:" if self.prefix else ""
            t = threading.Thread(target=_pump, args=(pipe, prefix, sink),
                                 name=f"sdprun-{tag}-{rank}", daemon=True)
            t.start()
            pumps.append(t)
        return Worker(rank, proc, pumps)

    def add(self, rank: int, env: Mapping[str, str]) -> Worker:
        """Start one more worker (labelled ``rank``) while the group runs: elastic growth
        (``sdprun -w``).  Raises ``RuntimeError`` once the group is stopping, ``OSError`` if the
        command cannot be started."""
        with self._add_lock:
            if self._stopping or self._stop_signal is not None:
                raise RuntimeError("the job is stopping; no new workers are started")
            w = self._start_one(rank, env)
            self.envs.append(dict(env))
            self.workers.append(w)
        log.debug("started worker %d: pid %d", rank, w.pid)
        return w

    def request_stop(self, signum: int) -> None:
        """Ask :meth:`wait` to stop all workers, forwarding ``signum`` to them.  Safe to call
        from a signal handler; a second request while stopping escalates to SIGKILL."""
        if self._stop_signal is not None or self._stopping:
            for w in self.workers:
                _signal_group(w.pid, signal.SIGKILL)
        if self._stop_signal is None:
            self._stop_signal = signum
        self._wakeup.set()

    def wait(self) -> int:
        """Block until the job ends; return the launcher's exit status.

        * all workers exit 0 → 0;
        * a worker fails → the others are stopped (SIGTERM, SIGKILL after the grace period) and
          the first failing worker's status is returned (killed by signal S → 128+S);
        * :meth:`request_stop` (sdprun got SIGINT/SIGTERM) → the signal is forwarded, then
          SIGKILL after the grace period; returns 128+signum.
        """
        while True:
            if self._stop_signal is not None:
                signum = self._stop_signal
                log.warning("sdprun received signal %d; stopping %d workers", signum, len(self.workers))
                self.stop(signum)
                return 128 + signum
            failed = None
            running = 0
            for w in self.workers:
                rc = w.proc.poll()
                if rc is None:
                    running += 1
                elif rc != 0 and failed is None:
                    failed = w
            if failed is not None:
                code = exit_code(failed.proc.returncode)
                how = (f"was killed by signal {-failed.proc.returncode}" if failed.proc.returncode < 0
                       else f"exited with code {code}")
                log.error("worker %d (pid %d) %s; stopping the other workers", failed.rank, failed.pid, how)
                self.stop(signal.SIGTERM)
                return code
            if running == 0:
                self.stop(signal.SIGTERM)  # leftovers the workers started, if any; then drain
                return 0
            self._wakeup.wait(_POLL_S)

    @staticmethod
    def _live(workers: List[Worker]) -> List[Worker]:
        """Workers still running, or whose process group still has live members."""
        running = [w for w in workers if w.proc.poll() is None]
        groups = _live_groups(w.pid for w in workers if w.proc.returncode is not None)
        return running + [w for w in workers if w.proc.returncode is not None and w.pid in groups]

    def stop(self, sig: int = signal.SIGTERM, grace_s: Optional[float] = None) -> None:
        """Send ``sig`` to every worker's process group, wait up to ``grace_s`` seconds
        (default: the group's grace period) for them to end, then SIGKILL what is left, reap the
        workers and flush their remaining output.  Idempotent."""
        grace_s = self.grace_s if grace_s is None else grace_s
        with self._add_lock:  # no worker is added after this point
            self._stopping = True
        live = self._live(self.workers)
        for w in live:
            _signal_group(w.pid, sig)
        deadline = time.monotonic() + grace_s
        while live and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            live = self._live(live)
        for w in live:
            log.warning("worker %d (pid %d) still running %.3g s after signal %d; killing it",
                        w.rank, w.pid, grace_s, sig)
            _signal_group(w.pid, signal.SIGKILL)
        for w in self.workers:
            try:
                w.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
                log.error("worker %d (pid %d) did not die after SIGKILL", w.rank, w.pid)
        for w in self.workers:
            for t in w.pumps:
                t.join(timeout=2)

"""Worker supervision of ``sdprun``: start the ranks, prefix their output, watch them, stop them.

How a rank is started is a :class:`~sdp.launcher.base.Launcher`'s job (:mod:`sdp.launcher.local`,
:mod:`sdp.launcher.ssh`); :class:`WorkerGroup` only sees :class:`~sdp.launcher.base.RankProcess`
objects.  Stopping means: the signal (SIGTERM by default) to every rank and all it started, then
SIGKILL to those still alive after a grace period.

Output: every line a worker writes is shown with its ``[rank]<stdout>:`` / ``[rank]<stderr>:``
prefix.  A progress bar that redraws itself in place (Keras' ``Progbar``, ``model.fit(verbose=1)``,
tqdm: text ending in a carriage return instead of a newline) is shown as lines too, at most one
every ``PROGRESS_INTERVAL_S`` (10 s) per stream, the first at once; the final line always.

A hung rank: when a rank's output reports a stall (the engine's ``stall: ... missing ranks [R, ...]``
warning, which rank 0 logs after ``SDP_STALL_CHECK_TIME`` seconds), each missing rank is sent
``STACK_SIGNAL`` (SIGUSR1) once; a rank started under ``sdprun`` prints every thread's Python stack
on it, the script's thread first (:mod:`sdp.common.rank_signals`), which appears under the rank's
prefix after a line naming the rank and its host.

TensorFlow's ``Local rendezvous is aborting with status: ...`` warning (and its ``[[{{node ...}}]]``
line), which repeats the error a failed graph collective raises next, is left out unless
``SDP_LOG_LEVEL=debug``: a rank prints sdp's error once (:mod:`sdp.common.rank_signals`).

A Horovod, SMDDP or KungFu script run without ``--compat``: when a rank's output has
``ModuleNotFoundError: No module named 'horovod'`` (or ``smdistributed``, ``kungfu``) and the job
did not name that family in ``--compat``, a failed job ends with one line saying to add
``--compat horovod`` (the family).
"""
import itertools
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Callable, List, Mapping, Optional, Sequence

from sdp.common.compat_names import COMPAT_ENV, FAMILIES, parse_families
from sdp.common.rank_signals import STACK_SIGNAL
from sdp.launcher.base import Launcher, RankProcess
from sdp.launcher.local import LocalLauncher

log = logging.getLogger("sdp.launcher")

DEFAULT_GRACE_S = 3.0
_POLL_S = 0.05
_MAX_LINE = 1 << 16  # bytes; a longer line without newline is emitted in pieces
#: seconds: the least time between two in-place progress lines shown from one stream
PROGRESS_INTERVAL_S = 10.0
_EOL = re.compile(rb"\r\n|\n|\r")
_STALL = re.compile(r"missing ranks \[([0-9, ]*)\]")
_TF_ABORTING = re.compile(r"local_rendezvous\.cc:\d+\] Local rendezvous is aborting with status")
_NO_FAMILY = re.compile(r"No module named '(%s)[.']" % "|".join(FAMILIES))


def exit_code(returncode: int) -> int:
    """Shell-style exit status of a ``Popen.returncode``: a process killed by signal S → 128+S."""
    return 128 - returncode if returncode < 0 else returncode


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


def _pump(pipe: IO[bytes], prefix: str, sink: _Sink, on_line: Optional[Callable[[str], None]] = None,
          clock: Callable[[], float] = time.monotonic, quiet_tf: bool = False) -> None:
    """Copy ``pipe`` to ``sink`` line by line, each line starting with ``prefix``; call
    ``on_line(text)`` for each line shown.  Text ended by a lone carriage return (a progress bar
    redrawn in place) is shown at most every ``PROGRESS_INTERVAL_S`` seconds; the rest of such
    updates are dropped (the next newline-ended line supersedes them).  ``quiet_tf``: leave out
    TensorFlow's aborting-rendezvous warning and its node line (see the module docstring)."""
    node_line_next = False

    def show(raw: bytes) -> None:
        nonlocal node_line_next
        text = raw.replace(b"\b", b"").decode("utf-8", errors="replace")
        if quiet_tf:
            dropped = _TF_ABORTING.search(text) is not None or (node_line_next and text.startswith("\t [[{{node"))
            node_line_next = _TF_ABORTING.search(text) is not None
            if dropped:
                return
        sink.write(prefix + text + "\n")
        if on_line is not None:
            on_line(text)

    shown_at = -float("inf")
    buf = b""
    with pipe:
        while True:
            chunk = pipe.read1(_MAX_LINE)
            buf += chunk
            # a trailing \r may be the first half of \r\n: wait for the next read
            end = len(buf) - 1 if chunk and buf.endswith(b"\r") else len(buf)
            pos = 0
            for m in _EOL.finditer(buf, 0, end):
                piece = buf[pos:m.start()]
                pos = m.end()
                if m.group() != b"\r":
                    show(piece)
                elif piece.strip(b"\b \t"):
                    now = clock()
                    if now - shown_at >= PROGRESS_INTERVAL_S:
                        shown_at = now
                        show(piece)
            buf = buf[pos:]
            if buf and (len(buf) >= _MAX_LINE or not chunk):
                show(buf)
                buf = b""
            if not chunk:
                return


def _pump_logged(pipe: IO[bytes], prefix: str, sink: _Sink, on_line: Optional[Callable[[str], None]],
                 log_path: Optional[str], quiet_tf: bool = False) -> None:
    """:func:`_pump`, each line shown also written (unprefixed) to the file ``log_path`` if given."""
    if not log_path:
        return _pump(pipe, prefix, sink, on_line, quiet_tf=quiet_tf)
    with open(log_path, "w", encoding="utf-8", buffering=1) as logf:
        def line(text: str) -> None:
            logf.write(text + "\n")
            if on_line is not None:
                on_line(text)
        _pump(pipe, prefix, sink, line, quiet_tf=quiet_tf)


class Worker:
    """One started rank: its :class:`~sdp.launcher.base.RankProcess` and output pump threads."""

    def __init__(self, rank: int, proc: RankProcess, pumps: List[threading.Thread], launcher: str):
        self.rank = rank
        self.proc = proc
        self.pumps = pumps
        self.launcher = launcher

    @property
    def pid(self) -> int:
        """The local process id standing for the rank (the rank, or its ssh client)."""
        return self.proc.pid


def _local_only(_host: str) -> Launcher:
    return _LOCAL


_LOCAL = LocalLauncher()


class WorkerGroup:
    """Start ``command`` once per environment in ``envs`` (rank = index) and supervise them.

    ``launcher_of(host)`` picks the :class:`~sdp.launcher.base.Launcher` of a rank from its
    ``SDP_HOSTNAME`` (default: every rank local).  ``stdout``/``stderr`` (default: the
    launcher's) receive the workers' lines prefixed with ``[rank]<stdout>:`` /
    ``[rank]<stderr>:`` (no prefix when ``prefix`` is false).  A local rank 0 inherits the
    launcher's stdin; the other ranks read from ``/dev/null``.
    ``logdir`` (kungfu-run's ``-logdir``): each worker's lines also go, unprefixed, to
    ``logdir/worker<K>.rank<R>.stdout.log`` / ``.stderr.log`` (``K`` counts the workers started,
    so a rank started again by an elastic resize gets its own files).
    """

    def __init__(self, command: Sequence[str], envs: Sequence[Mapping[str, str]],
                 stdout: Optional[IO[str]] = None, stderr: Optional[IO[str]] = None,
                 prefix: bool = True, grace_s: float = DEFAULT_GRACE_S,
                 launcher_of: Optional[Callable[[str], Launcher]] = None, logdir: Optional[str] = None):
        self.command = list(command)
        self.logdir = logdir
        if logdir:
            os.makedirs(logdir, exist_ok=True)
        self._started = itertools.count()
        self.envs = list(envs)
        self.prefix = prefix
        self.grace_s = grace_s
        self.launcher_of = launcher_of or _local_only
        lock = threading.Lock()
        self._out = _Sink(stdout if stdout is not None else sys.stdout, lock)
        self._err = _Sink(stderr if stderr is not None else sys.stderr, lock)
        self.workers: List[Worker] = []
        self._wakeup = threading.Event()
        self._stop_signal: Optional[int] = None
        self._stopping = False
        self._add_lock = threading.Lock()
        self._stacks_asked: set = set()  # ranks already sent STACK_SIGNAL
        self._families_missing: set = set()  # compat families a rank failed to import

    def start(self) -> "WorkerGroup":
        """Start all workers.  Raises ``OSError`` (e.g. ``FileNotFoundError`` for an unknown
        command) after stopping the workers already started."""
        try:
            for rank, env in enumerate(self.envs):
                self.workers.append(self._start_one(rank, env))
        except BaseException:
            self.stop(signal.SIGKILL, grace_s=0)
            raise
        log.debug("started %d workers: %s", len(self.workers),
                  ", ".join(f"{w.rank}: {w.launcher} pid {w.pid}" for w in self.workers))
        return self

    def _start_one(self, rank: int, env: Mapping[str, str]) -> Worker:
        launcher = self.launcher_of(env.get("SDP_HOSTNAME", ""))
        proc = launcher.start(rank, self.command, env, inherit_stdin=rank == 0)
        pumps = []
        label = f"worker{next(self._started)}.rank{rank}"  # unique: a rank may be started again (-w)
        for pipe, tag, sink in ((proc.stdout, "stdout", self._out), (proc.stderr, "stderr", self._err)):
            prefix = f"[{rank}]<{tag}>:" if self.prefix else ""
            log_path = os.path.join(self.logdir, f"{label}.{tag}.log") if self.logdir else None
            quiet_tf = env.get("SDP_LOG_LEVEL", "").strip().lower() not in ("debug", "10")
            t = threading.Thread(target=_pump_logged, args=(pipe, prefix, sink, self._watch_line, log_path, quiet_tf),
                                 name=f"sdprun-{tag}-{rank}", daemon=True)
            t.start()
            pumps.append(t)
        return Worker(rank, proc, pumps, launcher.name)

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

    def _watch_line(self, text: str) -> None:
        """A worker's output line: on the engine's stall warning, ask each missing rank (once
        per job) for its Python stacks; note a compat family the script failed to import (see
        the module docstring)."""
        if "No module named" in text:
            self._families_missing.update(_NO_FAMILY.findall(text))
        if "stall:" not in text:
            return
        missing = {int(r) for group in _STALL.findall(text) for r in group.split(",") if r.strip()}
        for rank in sorted(missing - self._stacks_asked):
            self._stacks_asked.add(rank)
            # (one mpirun / srun for all ranks has no SDP_RANK: not ours to ask)
            found = [(w, env) for w, env in zip(self.workers, self.envs) if env.get("SDP_RANK") == str(rank)]
            if not found or found[0][0].proc.poll() is not None:
                continue
            worker, env = found[0]
            host = env.get("SDP_HOSTNAME") or "this host"
            log.warning("rank %d (host %s, %s pid %d) is missing from a collective; "
                        "its Python stacks follow", rank, host, worker.launcher, worker.pid)
            worker.proc.signal(STACK_SIGNAL)

    def request_stop(self, signum: int) -> None:
        """Ask :meth:`wait` to stop all workers, forwarding ``signum`` to them.  Safe to call
        from a signal handler; a second request while stopping escalates to SIGKILL."""
        if self._stop_signal is not None or self._stopping:
            for w in self.workers:
                w.proc.signal(signal.SIGKILL)
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
                rc = failed.proc.poll()
                code = exit_code(rc)
                how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {code}"
                if failed.launcher == "ssh" and rc == 255:
                    how += " (255: ssh itself failed, see its message above)"
                log.error("worker %d (%s pid %d) %s; stopping the other workers", failed.rank,
                          failed.launcher, failed.pid, how)
                self.stop(signal.SIGTERM)  # (its pumps have shown every line then)
                self._hint_compat()
                return code
            if running == 0:
                self.stop(signal.SIGTERM)  # leftovers the workers started, if any; then drain
                return 0
            self._wakeup.wait(_POLL_S)

    def _hint_compat(self) -> None:
        """One line for each compat family a rank could not import and ``--compat`` left out."""
        try:
            given = set(parse_families(self.envs[0].get(COMPAT_ENV, ""))) if self.envs else set()
        except ValueError:
            given = set()
        for family in sorted(self._families_missing - given):
            log.error("the script imports %s, which sdp provides under its name only with --compat: "
                      "add --compat %s (sdprun --compat %s -np N ...)", family, family, family)

    def stop(self, sig: int = signal.SIGTERM, grace_s: Optional[float] = None) -> None:
        """Send ``sig`` to every worker and all it started, wait up to ``grace_s`` seconds
        (default: the group's grace period) for them to end, then SIGKILL what is left, reap the
        workers and flush their remaining output.  Idempotent."""
        grace_s = self.grace_s if grace_s is None else grace_s
        with self._add_lock:  # no worker is added after this point
            self._stopping = True
        live = [w for w in self.workers if w.proc.tree_alive()]
        for w in live:
            w.proc.signal(sig)
        deadline = time.monotonic() + grace_s
        while live and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            live = [w for w in live if w.proc.tree_alive()]
        for w in live:
            log.warning("worker %d (%s pid %d) still running %.3g s after signal %d; killing it",
                        w.rank, w.launcher, w.pid, grace_s, sig)
            w.proc.signal(signal.SIGKILL)
        for w in self.workers:
            try:
                w.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
                log.error("worker %d (pid %d) did not die after SIGKILL", w.rank, w.pid)
        for w in self.workers:
            for t in w.pumps:
                t.join(timeout=2)

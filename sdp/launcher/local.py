"""Local ranks: child processes of ``sdprun`` on this machine (no ssh).

Each rank runs in its own session (``start_new_session=True``), so ``os.killpg(pid, sig)``
reaches the rank and everything it started; and it gets ``PR_SET_PDEATHSIG`` = SIGTERM, so it
ends when ``sdprun`` dies, even by SIGKILL; and ``SDP_LAUNCHER_PID`` names ``sdprun``, so that
the rank's whole process group ends with it even behind a wrapper (:mod:`sdp.transport.lifeline`).
:mod:`sdp.launcher.remote` uses the same helpers on the other hosts.
"""
import os
import signal
import subprocess
import sys
import threading
from typing import Iterable, Mapping, Sequence

from sdp.transport.lifeline import LAUNCHER_PID_ENV
from sdp.launcher.base import Launcher, RankProcess


def live_groups(pgids: Iterable[int]) -> set:
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


def die_with_parent() -> None:
    """In a child before exec: get SIGTERM when the thread that started it dies (even by
    SIGKILL), so no process is orphaned."""
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def pdeathsig_preexec():
    """``preexec_fn`` for ``Popen``: :func:`die_with_parent` where it works, else None.

    Linux delivers PDEATHSIG when the *thread* that forked exits, so only processes started
    from the main thread get it (elastic workers started from a server thread rely on the engine
    noticing its peers instead)."""
    main = threading.current_thread() is threading.main_thread()
    return die_with_parent if main and _PRCTL else None


def signal_group(pgid: int, sig: int) -> None:
    """``os.killpg`` that ignores a group that no longer exists."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class LocalProcess(RankProcess):
    """A rank started by :class:`LocalLauncher`: a ``Popen`` leading its own process group."""

    def signal(self, sig: int) -> None:
        signal_group(self.proc.pid, sig)

    def tree_alive(self) -> bool:
        return self.proc.poll() is None or self.proc.pid in live_groups([self.proc.pid])


class LocalLauncher(Launcher):
    """Start ranks as child processes of ``sdprun`` on this machine."""

    name = "local"

    def start(self, rank: int, command: Sequence[str], env: Mapping[str, str],
              inherit_stdin: bool = False) -> LocalProcess:
        env = {**env, LAUNCHER_PID_ENV: str(os.getpid())}  # the rank ends when we do (sdp.transport.lifeline)
        proc = subprocess.Popen(list(command), env=env, start_new_session=True,
                                stdin=None if inherit_stdin else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=pdeathsig_preexec())
        return LocalProcess(rank, proc)


def remove_job_files(job: str) -> int:
    """Remove what ranks of job ``job`` that were killed left on this machine: shared-memory
    segments (``/dev/shm/sdp-JOB-*``) and ipc socket directories (``$TMPDIR/sdp-JOB-*``).  Only
    once the job has ended (``sdprun``'s clean-up): the names do not tell a live rank's files
    apart.  Returns how many were removed."""
    import glob
    import shutil
    import tempfile
    from sdp.transport import shm
    removed = shm.remove_job_files(job)
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"sdp-{glob.escape(job)}-*")):
        shutil.rmtree(path, ignore_errors=True)
        removed += 1
    return removed


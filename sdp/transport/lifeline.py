"""A rank ends with its launcher: when ``sdprun`` is gone, so is every process of the rank.

``sdprun`` starts each local rank in a session of its own and puts its own pid in the rank's
environment as ``SDP_LAUNCHER_PID``.  The rank's direct child also gets ``PR_SET_PDEATHSIG``
(:mod:`sdp.launcher.local`), but a wrapper (``sdprun -np 2 bash -c "python w.py; echo done"``)
takes that signal in the wrapper's place: bash dies and python, orphaned, ran on (37 s and more
after ``kill -9`` of ``sdprun``).  So :func:`watch_launcher` (called by ``sdp.init()``) waits in
a daemon thread on a pidfd of the launcher (``os.pidfd_open``, Linux 5.3+: no pid-reuse race;
else it polls ``kill(pid, 0)`` every ``POLL_S``) and, when the launcher exits however it exits,
removes the job's shared-memory files (``SDP_JOB_ID``; a rank stopped during start-up may not
have unlinked its own yet) and sends SIGTERM to the rank's whole process group, then SIGKILL
``GRACE_S`` seconds later.  The group goes only when the rank has a session of its own (not the
launcher's); otherwise only this process ends.  A launcher that is not an ancestor of this
process is never watched (another pid namespace: the same number may be another process).  Ranks on other hosts are covered by :mod:`sdp.launcher.remote` (its standard input
reaches end-of-file when ``sdprun`` or its ssh session dies).
"""
import logging
import os
import select
import signal
import threading
import time
from typing import Mapping, Optional

from sdp.transport import shm

LAUNCHER_PID_ENV = "SDP_LAUNCHER_PID"
GRACE_S = 3.0  # seconds between SIGTERM and SIGKILL of the rank's process group
POLL_S = 1.0  # seconds between checks where there is no pidfd

log = logging.getLogger("sdp")
_watching = set()


def watch_launcher(env: Optional[Mapping[str, str]] = None) -> bool:
    """Start watching the launcher named by ``SDP_LAUNCHER_PID`` (once per pid); returns whether
    a watch runs.  Only a launcher that is an ancestor of this process is watched: a pid from
    another pid namespace (a container inside the rank) or of a launcher already gone is
    ignored, never a reason to end."""
    env = os.environ if env is None else env
    try:
        pid = int(env.get(LAUNCHER_PID_ENV, ""))
    except ValueError:
        return False
    if pid <= 1 or pid in _watching:
        return False
    if pid not in _ancestors():
        log.info("%s=%d is not an ancestor of this process; not watching it", LAUNCHER_PID_ENV, pid)
        return False
    try:
        whole_group = os.getsid(0) != os.getsid(pid)
    except OSError:
        whole_group = False
    _watching.add(pid)
    threading.Thread(target=_watch, args=(pid, whole_group), name="sdp-lifeline", daemon=True).start()
    return True


def _ancestors(limit: int = 64) -> set:
    """The pids of this process's parent, its parent, ... (from /proc; empty without it)."""
    out, pid = set(), os.getpid()
    for _ in range(limit):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            pid = int(stat[stat.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            break
        if pid <= 0:
            break
        out.add(pid)
    return out


def _watch(pid: int, whole_group: bool) -> None:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        fd = None
    except (OSError, AttributeError):  # no pidfd: poll
        while _alive(pid):
            time.sleep(POLL_S)
        fd = None
    if fd is not None:
        select.select([fd], [], [])  # readable once the process has exited
        os.close(fd)
    _end(pid, whole_group)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _end(pid: int, whole_group: bool) -> None:
    log.error("rank pid %d: the launcher (pid %d) is gone; ending this rank%s", os.getpid(), pid,
              "'s process group" if whole_group else "")
    job = os.environ.get("SDP_JOB_ID")
    if job:
        shm.remove_job_files(job)  # the whole job goes: no rank needs them any more
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            if whole_group:
                os.killpg(os.getpgrp(), sig)
            else:
                os.kill(os.getpid(), sig)
        except OSError:
            pass
        time.sleep(GRACE_S)

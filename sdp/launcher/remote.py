"""The remote side of an ssh-launched rank: ``python -m sdp.launcher.remote`` on the rank's host.

:mod:`sdp.launcher.ssh` runs this module through ``ssh`` and writes one JSON line to its standard
input (never a command line, which ``ps`` shows to every user)::

    {"command": ["python", "train.py"], "env": {"SDP_RANK": "2", "SDP_SECRET": "...", ...},
     "cwd": "/path/on/the/host", "grace_s": 3.0}

This module then starts ``command`` in ``cwd`` with its own environment updated by ``env``, in a
new session (its own process group), with standard input ``/dev/null`` and standard output and
error going straight back through ssh.  Afterwards its standard input carries control lines from
``sdprun``: ``signal N`` sends signal N to the rank's process group (Ctrl-C / SIGTERM forwarding).
When standard input reaches end-of-file -- ``sdprun`` closed it, or the ssh session was lost,
or ``sdprun`` was killed with SIGKILL and its ssh client with it -- the process group gets
SIGTERM and, ``grace_s`` seconds later, SIGKILL.  The module exits with the rank's status
(128+S when the rank was killed by signal S; 126 / 127 when ``command`` cannot be started;
2 for a bad job description) after removing the rank's leftover shared-memory files
(``/dev/shm/sdp-JOB-RANK-*``, left only by a rank killed early) and ipc directories.
"""
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from sdp.launcher.local import live_groups, pdeathsig_preexec, signal_group

#: bytes: the longest job description accepted on standard input
MAX_SPEC_BYTES = 1 << 20
_MAX_CONTROL_LINE = 64
EXIT_BAD_SPEC = 2


def _fail(code: int, message: str) -> "NoReturn":  # noqa: F821
    print(f"sdp.launcher.remote on {os.uname().nodename}: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


class _Lines:
    """Lines from a file descriptor, read with ``os.read`` (no buffered stream whose lock a
    daemon thread could hold at exit); a line longer than ``limit`` bytes is cut there."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buf = b""
        self.eof = False

    def readline(self, limit: int) -> bytes:
        while b"\n" not in self.buf and len(self.buf) < limit and not self.eof:
            chunk = os.read(self.fd, 65536)
            self.eof = not chunk
            self.buf += chunk
        cut = self.buf.find(b"\n") + 1 or min(len(self.buf), limit)
        line, self.buf = self.buf[:cut], self.buf[cut:]
        return line


def read_spec(stream: _Lines) -> dict:
    """Read and check the job description line; exits with status 2 naming what is wrong."""
    raw = stream.readline(MAX_SPEC_BYTES + 1)
    if not raw.endswith(b"\n"):
        _fail(EXIT_BAD_SPEC, "no complete job description on standard input "
                             f"({len(raw)} bytes; at most {MAX_SPEC_BYTES})")
    try:
        spec = json.loads(raw)
        command, env = spec["command"], spec["env"]
        cwd, grace_s = spec.get("cwd"), float(spec.get("grace_s", 3.0))
        ok = (isinstance(command, list) and command and all(isinstance(a, str) for a in command)
              and isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in env.items())
              and (cwd is None or isinstance(cwd, str)) and 0 <= grace_s <= 600)
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        _fail(EXIT_BAD_SPEC, "malformed job description on standard input")
    return {"command": command, "env": env, "cwd": cwd, "grace_s": grace_s}


def _end_group(pgid: int, grace_s: float) -> None:
    """SIGTERM to the process group, SIGKILL to what is left after ``grace_s`` seconds."""
    signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pgid in live_groups([pgid]) and time.monotonic() < deadline:
        time.sleep(0.05)
    signal_group(pgid, signal.SIGKILL)


def _watch_control(stream: _Lines, proc: subprocess.Popen, grace_s: float, done: threading.Event) -> None:
    """Apply ``signal N`` lines; on end-of-file end the rank's whole process group."""
    while True:
        line = stream.readline(_MAX_CONTROL_LINE)
        if not line:
            break
        word, _, arg = line.strip().partition(b" ")
        if word == b"signal":
            try:
                sig = signal.Signals(int(arg))
            except ValueError:
                continue
            signal_group(proc.pid, sig)
    if not done.is_set():
        _end_group(proc.pid, grace_s)


def _remove_leftovers(env: dict) -> None:
    job, rank = env.get("SDP_JOB_ID"), env.get("SDP_RANK")
    if not job or not rank:
        return
    pattern = f"sdp-{glob.escape(job)}-{glob.escape(rank)}-*"
    for path in glob.glob(os.path.join("/dev/shm", pattern)):
        try:
            os.unlink(path)
        except OSError:
            pass
    for path in glob.glob(os.path.join(env.get("TMPDIR") or tempfile.gettempdir(), pattern)):
        shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    """Run one rank as described on standard input; exit with its status."""
    stdin = _Lines(0)
    spec = read_spec(stdin)
    env = dict(os.environ)
    env.update(spec["env"])
    try:
        proc = subprocess.Popen(spec["command"], env=env, cwd=spec["cwd"], start_new_session=True,
                                stdin=subprocess.DEVNULL, preexec_fn=pdeathsig_preexec())
    except FileNotFoundError as e:
        _fail(127, f"cannot run {spec['command'][0]!r}: {e}")
    except OSError as e:
        _fail(126, f"cannot run {spec['command'][0]!r} in {spec['cwd']!r}: {e}")
    done = threading.Event()
    threading.Thread(target=_watch_control, args=(stdin, proc, spec["grace_s"], done),
                     name="sdp-remote-control", daemon=True).start()
    rc = proc.wait()
    done.set()
    if proc.pid in live_groups([proc.pid]):  # processes the rank started and left behind
        _end_group(proc.pid, min(spec["grace_s"], 1.0))
    _remove_leftovers(spec["env"])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 - rc if rc < 0 else rc)  # not sys.exit: the control thread may sit in a read


if __name__ == "__main__":
    main()

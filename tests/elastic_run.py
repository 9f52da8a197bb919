"""A running ``sdprun`` of an elastic test: its output lines as they come, waits on them.

Shared by tests/test_elastic_hosts.py (fake hosts on this machine, and emulated hosts)."""
import re
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, List, Optional

RESULT = re.compile(r"RESULT rank=(\d+) size=(\d+) epoch=(\d+) value=(\S+) resets=(\[.*?\]) done_ok=(\w+)")
PROGRESS = re.compile(r"PROGRESS worker=(\d+) rank=(\d+) size=(\d+) step=(\d+) host=(\S+) pid=(\d+) job=(\w+)")


class Discovery:
    """A discovery script printing the current contents of a file (one ``host:slots`` a line)."""

    def __init__(self, directory: Path, hosts: str):
        self.file = directory / "hosts"
        self.script = directory / "discover.sh"
        self.script.write_text(f"#!/bin/sh\ncat {self.file}\n")
        self.script.chmod(self.script.stat().st_mode | stat.S_IXUSR)
        self.set(hosts)

    def set(self, hosts: str) -> None:
        """``"h1:2,h2:2"`` -> the script prints those lines from now on."""
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text("".join(f"{h}\n" for h in hosts.split(",") if h))
        tmp.replace(self.file)


class Run:
    """``argv`` started with ``popen(argv, **kw)`` (stdout and stderr merged), read by a thread."""

    def __init__(self, popen: Callable, argv: List[str], **kw):
        self.stop_file = (kw.get("env") or {}).get("STOP_FILE")  # tests/workers_elastic.py's
        self.proc = popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
        self.lines: List[str] = []
        self.mark = 0  # index after the line the last wait matched
        self.job: Optional[str] = None  # SDP_JOB_ID, from the PROGRESS lines
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self.lines.append(None)  # end of output
            self._cond.notify_all()

    def wait_for(self, pred: Callable[[str], Optional[object]], timeout_s: float = 120, start: int = 0):
        """The first truthy ``pred(line)`` of the lines from index ``start`` on (waits for more);
        fails the test when the output ends or ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        i = start
        with self._cond:
            while True:
                while i < len(self.lines):
                    line = self.lines[i]
                    i += 1
                    if line is None:
                        raise AssertionError("sdprun ended first:\n" + self.text()[-6000:])
                    got = pred(line)
                    if got:
                        self.mark = i
                        return got
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"nothing matched within {timeout_s} s:\n" + self.text()[-6000:])
                self._cond.wait(left)

    def progress(self, cond: Callable[[dict], bool], timeout_s: float = 120, start: int = 0) -> dict:
        """The first ``PROGRESS`` line (as a dict of ints, ``host`` a string) for which ``cond``."""
        def pred(line):
            m = PROGRESS.search(line)
            if not m:
                return None
            d = dict(zip(("worker", "rank", "size", "step", "host", "pid", "job"), m.groups()))
            d = {k: (v if k in ("host", "job") else int(v)) for k, v in d.items()}
            self.job = d["job"]
            return d if cond(d) else None
        return self.wait_for(pred, timeout_s, start)

    def finish(self, timeout_s: float = 180) -> int:
        try:
            self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._reader.join(timeout=10)
        return self.proc.returncode

    def stop(self) -> None:
        """The workers (tests/workers_elastic.py, started with ``STOP_FILE`` in ``env``) end
        together after their next step: what the test checks has happened, the rest of
        ``STEPS`` would prove nothing more."""
        assert self.stop_file, "started without STOP_FILE"
        Path(self.stop_file).write_text("")

    def kill(self) -> None:
        """Kill sdprun if it still runs (a failed test's clean-up; sdprun's workers end with it)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def text(self) -> str:
        return "\n".join(x for x in self.lines if x is not None)

    def results(self):
        return [RESULT.search(x).groups() for x in self.lines if x is not None and RESULT.search(x)]

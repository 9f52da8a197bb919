"""Compiling sdp's native parts into a per-user cache, once per machine and source.

Shared by ``sdp.tensorflow.build_ops`` (the ``SdpCheck`` TensorFlow op, C++) and
``sdp.engine.native`` (the fast lane's compiled step, a C extension).  A library is named by
a hash of everything that shapes it (source, flags, versions), kept in ``$SDP_CACHE_DIR/<kind>/``
(default ``$XDG_CACHE_HOME/sdp``, else ``~/.cache/sdp``), and built under a file lock so that the
ranks of a job starting together compile it once.
"""
import argparse
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Sequence

from sdp.common.errors import SdpError

BUILD_TIMEOUT_S = 600.0


class BuildError(SdpError):
    """A native library could not be built: no compiler, or the compiler failed (its output is
    in the message)."""


def switched_on(env: str) -> bool:
    """False when ``$<env>`` is ``0``, ``false``, ``off`` or ``no`` (any case): a native part
    is not to be built or loaded."""
    return os.environ.get(env, "").strip().lower() not in ("0", "false", "off", "no")


def cache_dir(kind: str) -> Path:
    """Where built libraries of ``kind`` are kept: ``$SDP_CACHE_DIR/<kind>`` (default
    ``$XDG_CACHE_HOME/sdp``, else ``~/.cache/sdp``)."""
    base = os.environ.get("SDP_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "sdp")
    return Path(base) / kind


def digest(source: Path, parts: Iterable[str], length: int = 16) -> str:
    """Hex digest (``length`` characters) of ``source``'s bytes and ``parts``."""
    h = hashlib.sha256(source.read_bytes())
    for part in parts:
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:length]


def compiler(env: str, names: Sequence[str]) -> Optional[List[str]]:
    """The compiler's command: ``$<env>`` split as a shell would (if it names a program on
    ``PATH``), else the first of ``names`` on ``PATH``, or None."""
    chosen = os.environ.get(env, "").strip()
    if chosen:
        argv = shlex.split(chosen)
        return argv if shutil.which(argv[0]) else None
    for name in names:
        path = shutil.which(name)
        if path:
            return [path]
    return None


class FileLock:
    """An exclusive ``flock`` on ``path`` (created 0600) while in the ``with`` block: processes
    sharing a cache directory build one at a time."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = None

    def __enter__(self):
        import fcntl
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        import fcntl
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def build(out: Path, argv: Callable[[str], List[str]], force: bool = False) -> Path:
    """Run ``argv(tmp)`` (a compiler command writing ``tmp``) unless ``out`` exists (``force``:
    anyway), then move the result to ``out`` (readers never see a partial library).  Concurrent
    callers compile once: the first takes the directory's lock, the others wait and find it.
    Raises ``BuildError`` when the command cannot run, times out or fails."""
    if out.exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with FileLock(out.parent / ".build.lock"):
        if out.exists() and not force:  # another process built it while this one waited
            return out
        fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
        os.close(fd)
        cmd = argv(tmp)
        try:
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise BuildError(f"{shlex.join(cmd)}: {e}") from e
            if res.returncode != 0:
                tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-20:])
                raise BuildError(f"{shlex.join(cmd)} exited with {res.returncode}:\n{tail}")
            os.chmod(tmp, 0o755)
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


def main(argv, prog: str, what: str, library_path: Callable[[], Path], build_it: Callable[..., Path],
         check: Callable[[Path], str]) -> int:
    """The command line of a native part (``python -m <prog>``): build ``what`` into the cache
    (``--force``: again), then ``check(path)`` ('' when it loads and works, else why not);
    ``--print-path`` only prints where it is (or would be).  Returns the exit status."""
    p = argparse.ArgumentParser(prog=f"python -m {prog}", description=f"Compile {what} into the cache.")
    p.add_argument("--force", action="store_true", help="compile even if the cached library exists")
    p.add_argument("--print-path", action="store_true", help="only print where the library is (or would be)")
    args = p.parse_args(argv)
    path = library_path()
    if args.print_path:
        print(path)
        return 0
    existed = path.exists() and not args.force
    try:
        path = build_it(force=args.force)
    except BuildError as e:
        print(f"sdp: {e}", file=sys.stderr)
        return 1
    why = check(path)
    if why:
        print(f"sdp: {path}: {why}", file=sys.stderr)
        return 1
    print(f"sdp: {'cached' if existed else 'built'} {path}")
    return 0

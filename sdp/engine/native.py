"""Build and load the fast lane's compiled step (``sdp/engine/cc/lane_now.c``, issue 30).

A synchronous small allreduce between the ranks of one host (:meth:`sdp.engine.lane.Lane.allreduce_now`)
is ~60 short Python operations (~10 us back to back, ~27 us after 1 ms idle on a 2-core VM);
its common case (post, poll, reduce) is one call of this C extension instead, and
``sdp.allreduce`` enters it first (``Context.front``: the lane's checks, data-ring allocation and
result array too, for a name the Python path has run once).  The Python code stays the reference
and runs everything else, and all of it when the extension is missing.  The same extension holds
the host leaders' link's compiled step across hosts (``cc/link_now.c``, included by
``lane_now.c``: ``LinkFront``, :mod:`sdp.engine.hostlink`).  ``lane_now.c`` is one translation
unit in parts that it includes (``cc/lane_ring.c``: the context and its memory; ``lane_decide.c``:
the poll's look and rank 0's decisions; ``lane_reduce.c``: the reductions; ``lane_step.c``: post,
poll, reduce; ``lane_learn.c``, ``lane_front.c``, ``lane_batch.c``: the entries;
``lane_layout.c``: fusion.Layout's helpers); ``INCLUDED`` lists them for the build's hash.

* Built at the first lane or host leaders' link of a process (every rank at once: under a file lock, so one process
  per cache directory compiles it, ~1 s with gcc) into ``$SDP_CACHE_DIR/native/`` (default
  ``$XDG_CACHE_HOME/sdp`` or ``~/.cache/sdp``), named by a hash of the source, the Python ABI and
  the machine; ``python -m sdp.engine.native`` builds it ahead (``--force`` rebuilds).
* Needs a C compiler (``$CC``, else ``gcc``, ``cc`` or ``clang``), Python's headers and numpy's
  (in every numpy wheel; the hash names numpy's version too); without
  them, or with ``SDP_NATIVE=0``, the lane runs in Python (the reason is logged once, at debug
  level: nothing changes but speed).
"""
import importlib.machinery
import importlib.util
import logging
import platform
import sys
import sysconfig
import threading
from pathlib import Path

from sdp.common import native_build
from sdp.common.native_build import BuildError

log = logging.getLogger("sdp.engine")

SOURCE = Path(__file__).resolve().parent / "cc" / "lane_now.c"
#: the parts SOURCE #includes (every other ``.c``/``.h`` in its folder: lane_*.c, link_now.c), hashed
#: with it so that a change to any part rebuilds
INCLUDED = tuple(sorted(p for p in SOURCE.parent.iterdir() if p.suffix in (".c", ".h") and p != SOURCE))
SWITCH = "SDP_NATIVE"  # 0: never build or load the extension (the lane runs in Python)
MODULE = "_sdp_lane"

_lock = threading.Lock()
_state = {}  # "module": the loaded extension, or None once decided


def enabled() -> bool:
    """False when ``SDP_NATIVE=0`` (or ``false``/``off``/``no``)."""
    return native_build.switched_on(SWITCH)


def _flags() -> list:
    import numpy
    return ["-shared", "-fPIC", "-O3", "-fno-strict-aliasing", f"-I{sysconfig.get_paths()['include']}",
            f"-I{numpy.get_include()}"]


def library_path() -> Path:
    """The extension for this source, Python and machine (it may not exist yet)."""
    import numpy
    h = native_build.digest(SOURCE, [sys.implementation.cache_tag, platform.machine(), sys.version, numpy.__version__,
                                     *_flags(), *(p.read_text() for p in INCLUDED)])
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return native_build.cache_dir("native") / f"{MODULE}-{h}{suffix}"


def build(force: bool = False) -> Path:
    """Compile the extension unless it is cached (``force``: anyway); returns its path.  Raises
    :class:`BuildError` without a C compiler or Python's headers, or when compiling fails."""
    out = library_path()
    if out.exists() and not force:
        return out
    cc = native_build.compiler("CC", ("gcc", "cc", "clang"))
    if cc is None:
        raise BuildError("no C compiler: set CC or install gcc (e.g. apt-get install gcc)")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        raise BuildError(f"no Python.h in {sysconfig.get_paths()['include']} (e.g. apt-get install python3-dev)")
    return native_build.build(out, lambda tmp: [*cc, *_flags(), str(SOURCE), "-o", tmp], force)


def _import(path: Path):
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load():
    """The loaded extension module, or None (``SDP_NATIVE=0``, not x86-64/Linux, no compiler,
    a failed build or import).  Decided once per process; the reason for None is logged once."""
    if not enabled():
        return None
    with _lock:
        if "module" not in _state:
            _state["module"], _state["why"] = _load()
            if _state["module"] is None:
                log.debug("sdp: the fast lane runs in Python (%s)", _state["why"])
        return _state["module"]


def loaded():
    """The extension if this process has loaded it (:func:`load`), else None: nothing is built
    or imported here (for :class:`sdp.engine.fusion.Layout`, used where no lane loads it too)."""
    return _state.get("module")


def _load():
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"not built for {sys.platform}/{platform.machine()} (its memory ordering is x86-64's)"
    try:
        return _import(build()), ""
    except BuildError as e:
        return None, f"building it failed: {e}"
    except (ImportError, OSError) as e:
        return None, f"loading it failed: {e}"


def _check(path: Path) -> str:
    try:
        _import(path)
    except (ImportError, OSError) as e:
        return f"loading it failed: {e}"
    return ""


def main(argv=None) -> int:
    return native_build.main(argv, "sdp.engine.native", "sdp's fast-lane step (a C extension)", library_path, build,
                             _check)


if __name__ == "__main__":
    sys.exit(main())

"""``horovod.run``: call a Python function on every rank of a new job and return the results.

:func:`run` starts its ranks exactly like ``sdprun`` (:func:`sdp.launcher.cli.main`: local ranks
as child processes, ranks on other hosts through ssh, the job secret, the rendezvous on the right
interface); each rank runs ``python -m sdp.launcher.run_func``, which unpickles
``(fn, args, kwargs)`` from ``SDP_RUN_FUNC`` (base64; the variable travels in the environment,
over ssh's standard input for remote ranks), calls ``fn(*args, **kwargs)`` and sends the pickled
result back on its standard output in marked lines that :func:`run` takes out of the output.

Limits (as with Horovod's own ``horovod.run``, which uses cloudpickle -- not installed here):

* ``fn``, ``args``, ``kwargs`` and the results are pickled with the standard :mod:`pickle`, so
  ``fn`` is pickled *by name*: it must be a top-level function of a module the ranks can import
  (on every host, at the same path), or of the caller's main script when that script guards its
  work with ``if __name__ == "__main__":`` (the rank runs the script as ``__mp_main__`` first, as
  ``multiprocessing``'s spawn method does).  Lambdas and nested functions fail with
  ``pickle.PicklingError`` before anything starts.
* ``args`` and ``kwargs`` must stay small: they travel in an environment variable (Linux caps one
  at 128 KiB).
"""
import base64
import os
import pickle
import sys
import threading
import traceback
from typing import Dict, List, Optional, Sequence

from sdp.common import compat_names

ENV_FUNC = "SDP_RUN_FUNC"
ENV_MAIN = "SDP_RUN_MAIN"
MARK = "SDP-RUN-RESULT"
_CHUNK = 30000  # characters of base64 per marked line (sdprun splits lines over 64 KiB)


class _Collector:
    """The text stream the workers' stdout goes to: marked result lines are kept, others passed
    on to ``out``.  Lines arrive whole (``[rank]<stdout>:text\\n``)."""

    def __init__(self, out):
        self.out = out
        self.lock = threading.Lock()
        self.chunks: Dict[int, Dict[int, str]] = {}
        self.totals: Dict[int, int] = {}
        self.order: List[int] = []  # ranks in the order their result completed

    def write(self, text: str) -> None:
        head, sep, body = text.partition(">:")
        if sep and head.startswith("[") and body.startswith(MARK + " "):
            try:
                rank = int(head[1:head.index("]")])
                _, index, total, data = body.split()
                with self.lock:
                    self.chunks.setdefault(rank, {})[int(index)] = data
                    self.totals[rank] = int(total)
                    if len(self.chunks[rank]) == int(total):
                        self.order.append(rank)
                return
            except ValueError:
                pass
        self.out.write(text)

    def flush(self) -> None:
        self.out.flush()

    def result(self, rank: int):
        """``(ok, value)`` sent by ``rank``, or None when it sent nothing complete."""
        parts = self.chunks.get(rank, {})
        if rank not in self.totals or len(parts) != self.totals[rank]:
            return None
        return pickle.loads(base64.b64decode("".join(parts[i] for i in range(self.totals[rank]))))


def run(fn, args=(), kwargs=None, np: int = 1, hosts: Optional[str] = None, hostfile: Optional[str] = None,
        env: Optional[dict] = None, start_timeout: Optional[float] = None,
        network_interface: Optional[str] = None, ssh_port: Optional[int] = None,
        ssh_identity_file: Optional[str] = None, verbose=None, compat: Sequence[str] = (),
        compat_forced: Sequence[str] = (), **ignored) -> list:
    """Mirror of ``horovod.run``: call ``fn(*args, **kwargs)`` on ``np`` ranks and return their
    results as a list in rank order.

    ``hosts`` (``"h1:2,h2:2"``) or ``hostfile`` place the ranks as ``sdprun -H`` / ``--hostfile``
    do (default: all on this machine); ``network_interface``, ``ssh_port``,
    ``ssh_identity_file``, ``start_timeout`` (seconds) are ``sdprun``'s ``-nic``,
    ``--ssh-port``, ``--ssh-identity-file``, ``--start-timeout``; ``env`` adds variables on every
    rank (forwarded to remote ranks too).  Horovod's other keywords (``use_gloo``, ``use_mpi``,
    ``executable``, ...) are accepted and ignored.  ``compat`` / ``compat_forced``:
    the compatibility families to activate in the ranks (``sdprun --compat``) and those to force
    (``SDP_COMPAT_FORCE``); :func:`sdp.compat.run` passes the ones active in the caller
    (:func:`sdp.compat.install`).  See the module docstring for what
    must be picklable.

    Raises ``ValueError`` for a bad ``np``/host list, ``pickle.PicklingError`` (or
    ``AttributeError``/``TypeError``) when ``fn`` or its arguments cannot be pickled, and
    ``RuntimeError("horovod.run: rank R failed: ...")`` with the failing rank's exception and
    traceback when a rank fails (the other ranks are stopped)."""
    from sdp.launcher import cli
    from sdp.launcher import hosts as hostlib

    if np < 1:
        raise ValueError(f"horovod.run: np must be at least 1, got {np}")
    if hosts:
        hostlib.parse_hosts(hosts)  # ValueError now, not a log line
    payload = base64.b64encode(pickle.dumps((fn, tuple(args), dict(kwargs or {})))).decode()
    base = dict(os.environ)
    base.update({str(k): str(v) for k, v in (env or {}).items()})
    base[ENV_FUNC] = payload
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if main and getattr(fn, "__module__", None) == "__main__":
        base[ENV_MAIN] = os.path.abspath(main)
    argv = ["-np", str(np), "--start-timeout", f"{float(start_timeout or base.get('SDP_START_TIMEOUT') or 60):g}"]
    argv += ["-H", hosts] if hosts else ["--hostfile", hostfile] if hostfile else []
    argv += ["-nic", network_interface] if network_interface else []
    argv += ["--ssh-port", str(ssh_port)] if ssh_port else []
    argv += ["--ssh-identity-file", ssh_identity_file] if ssh_identity_file else []
    argv += ["--verbose"] if verbose else []
    for k in env or {}:
        argv += ["-x", str(k)]
    argv += _compat_args(base, compat, compat_forced)
    collector = _Collector(sys.stdout)
    code = cli.main(argv + ["--", sys.executable, "-m", "sdp.launcher.run_func"], stdout=collector,
                    base_env=base)
    results, failure = {}, None
    for rank in collector.order + [r for r in range(np) if r not in collector.order]:
        got = collector.result(rank)
        if got is None:
            if failure is None and code != 0:
                failure = (rank, f"the process ended (sdprun status {code}) without a result")
            continue
        ok, value = got
        if ok:
            results[rank] = value
        elif failure is None or failure[1].startswith("the process ended"):
            failure = (rank, value)
    if failure is None and (code != 0 or len(results) != np):
        failure = (min(set(range(np)) - set(results), default=0), f"sdprun exited with status {code}")
    if failure is not None:
        raise RuntimeError(f"horovod.run: rank {failure[0]} failed: {failure[1]}")
    return [results[r] for r in range(np)]


def _compat_args(base: dict, active: Sequence[str], forced: Sequence[str]) -> List[str]:
    """``--compat`` for the families ``active`` in the caller (the ranks re-import the caller's
    main script, which may ``import horovod``), with ``SDP_COMPAT_FORCE`` for those ``forced``
    there (:func:`sdp.compat.run` passes both; the launcher never imports the faces)."""
    if not active:
        return []
    if forced:
        base[compat_names.FORCE_ENV] = ",".join(forced)
    return ["--compat", ",".join(active)]


# ---------------------------------------------------------------- the rank's side

def _load_main(path: str) -> None:
    """Run the caller's main script as ``__mp_main__`` and make it ``__main__``, so that
    functions pickled as ``__main__.name`` resolve (what multiprocessing's spawn does)."""
    import types
    module = types.ModuleType("__mp_main__")
    module.__file__ = path
    module.__builtins__ = __builtins__
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module
    sys.path.insert(0, os.path.dirname(path))
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    exec(code, module.__dict__)  # noqa: S102 - the caller's own script


def _send(ok: bool, value) -> None:
    try:
        data = pickle.dumps((ok, value))
    except Exception as e:  # noqa: BLE001 - an unpicklable result
        data = pickle.dumps((False, f"cannot send the result of rank {os.environ.get('SDP_RANK')} "
                                    f"back: {e!r}"))
    text = base64.b64encode(data).decode()
    chunks = [text[i:i + _CHUNK] for i in range(0, len(text), _CHUNK)] or [""]
    out = sys.__stdout__
    out.flush()
    for i, chunk in enumerate(chunks):
        out.write(f"{MARK} {i} {len(chunks)} {chunk}\n")
    out.flush()


def _worker_main() -> int:
    payload = os.environ.pop(ENV_FUNC, None)
    if payload is None:
        print(f"sdp.launcher.run_func: {ENV_FUNC} is not set (started by horovod.run only)", file=sys.stderr)
        return 2
    try:
        main = os.environ.pop(ENV_MAIN, None)
        if main:
            _load_main(main)
        fn, args, kwargs = pickle.loads(base64.b64decode(payload))
        value = fn(*args, **kwargs)
    except BaseException as e:  # report everything, including SystemExit
        _send(False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        return 1
    _send(True, value)
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main())

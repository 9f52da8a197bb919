"""Start N real worker processes that meet over real sockets, and collect what each returns.

``run_workers(n, "module:function", args)`` starts ``n`` Python processes with the ``SDP_*``
environment ``sdprun`` would give them (a rendezvous server runs in the test process); each calls
``sdp.init()`` then ``module.function(*args)`` from ``tests/`` and sends back its JSON-able return
value.  Returns one :class:`WorkerResult` per rank.
"""
import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import List, Optional

from sdp.transport.rendezvous import RendezvousServer
from sdp.transport.security import SECRET_ENV, new_secret

TESTS = os.path.dirname(os.path.abspath(__file__))
MARK = "@@RESULT@@"

BOOT = f"""
import json, sys, traceback
sys.path.insert(0, {TESTS!r})
mod, fn = sys.argv[1].split(":")
args = json.loads(sys.argv[2])
import importlib
m = importlib.import_module(mod)
try:
    if sys.argv[3] == "1":
        import sdp; sdp.init()
    out = getattr(m, fn)(*args)
    print({MARK!r} + json.dumps({{"ok": True, "value": out}}), flush=True)
except BaseException as e:
    traceback.print_exc()
    print({MARK!r} + json.dumps({{"ok": False, "type": type(e).__name__, "msg": str(e)}}), flush=True)
    sys.exit(1)
"""


@dataclasses.dataclass
class WorkerResult:
    rank: int
    returncode: Optional[int]
    ok: bool
    value: object
    error_type: Optional[str]
    error: Optional[str]
    stdout: str
    stderr: str
    elapsed: float


def worker_env(rank: int, size: int, address: str, extra=None, local_size=None, secret=None) -> dict:
    env = dict(os.environ)
    if secret is not None:
        env[SECRET_ENV] = secret  # the job secret, as sdprun gives it
    local_size = local_size or size
    env.update({"SDP_RANK": str(rank), "SDP_SIZE": str(size), "SDP_LOCAL_RANK": str(rank % local_size),
                "SDP_LOCAL_SIZE": str(local_size), "SDP_CROSS_RANK": str(rank // local_size),
                "SDP_CROSS_SIZE": str(size // local_size), "SDP_RENDEZVOUS_ADDR": address,
                "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
                "OMP_NUM_THREADS": "1"})
    env.update(extra or {})
    return env


def run_workers(n: int, target: str, args=(), env=None, timeout: float = 120, init: bool = True,
                per_rank_env=None) -> List[WorkerResult]:
    """Run ``target`` on ``n`` ranks; kill all and fail the test after ``timeout`` seconds."""
    secret = new_secret()
    srv = RendezvousServer(n, timeout_s=30, secret=secret).start()
    env = {"SDP_JOB_ID": os.urandom(6).hex(), **(env or {})}  # as sdp's launchers: they serve the rendezvous
    procs, t0 = [], time.monotonic()
    try:
        for r in range(n):
            e = worker_env(r, n, srv.address, env, secret=secret)
            if per_rank_env:  # (a value of None removes the variable)
                e.update(per_rank_env(r))
                e = {k: v for k, v in e.items() if v is not None}
            procs.append(subprocess.Popen(
                [sys.executable, "-c", BOOT, target, json.dumps(list(args)), "1" if init else "0"],
                env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        results, deadline = [], t0 + timeout
        for r, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                out, err = p.communicate()
                raise AssertionError(f"rank {r} did not finish within {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
            results.append(_parse(r, p.returncode, out, err, time.monotonic() - t0))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        srv.stop()


def _parse(rank, code, out, err, elapsed) -> WorkerResult:
    line = next((ln for ln in reversed(out.splitlines()) if ln.startswith(MARK)), None)
    if line is None:
        return WorkerResult(rank, code, False, None, "NoResult", "worker printed no result", out, err, elapsed)
    d = json.loads(line[len(MARK):])
    return WorkerResult(rank, code, d["ok"], d.get("value"), d.get("type"), d.get("msg"), out, err, elapsed)


def check_ok(results: List[WorkerResult]) -> list:
    """Assert every rank succeeded; return their values in rank order."""
    for r in results:
        assert r.ok, f"rank {r.rank} failed: {r.error_type}: {r.error}\n{r.stderr[-3000:]}"
    return [r.value for r in results]


def run_cases(n: int, cases, env=None, timeout: float = 240, **kw) -> dict:
    """One launch of ``n`` ranks for several cases: ``cases`` is ``[(key, "module:function", args),
    ...]``; every rank runs them in that order (so their collectives pair up as in one script) and
    records each case's return value or exception apart.  Returns ``{key: [WorkerResult per rank]}``,
    so ``check_ok(runs[key])`` fails naming that case's own error.  For cases that differ only in
    what they check (modes, dtypes): one launch pays the interpreter and TensorFlow start-up once
    (~4-8 s per launch on 2 cores) instead of once per case.  Cases needing different process-wide
    settings (environment, eager off, thread pools) need launches of their own."""
    cases = [list(c) for c in cases]
    assert len({c[0] for c in cases}) == len(cases), "case keys must differ"
    results = run_workers(n, "harness:_cases", [cases], env=env, timeout=timeout, **kw)
    out = {}
    for i, (key, target, _) in enumerate(cases):
        per_rank = []
        for r in results:
            if not r.ok:  # the process itself failed (a crash, or the harness's own error)
                per_rank.append(dataclasses.replace(r, error=f"[case {key!r} of one launch] {r.error}"))
                continue
            c = r.value[i]
            per_rank.append(dataclasses.replace(
                r, ok=c["ok"], value=c.get("value"), error_type=c.get("type"),
                error=None if c["ok"] else f"[case {key!r}: {target}] {c['msg']}",
                stderr=r.stderr if c["ok"] else r.stderr + f"\n--- case {key!r}:\n" + c["tb"]))
        out[key] = per_rank
    return out


def _cases(cases):
    """The worker side of :func:`run_cases` (runs inside each rank)."""
    import importlib
    import traceback
    import time
    out = []
    for key, target, args in cases:
        t0 = time.monotonic()
        mod, fn = target.split(":")
        try:
            out.append({"ok": True, "value": getattr(importlib.import_module(mod), fn)(*args)})
        except Exception as e:  # noqa: BLE001  (recorded for this case; the next case still runs)
            out.append({"ok": False, "type": type(e).__name__, "msg": str(e), "tb": traceback.format_exc()})
        print(f"case {key!r} done in {time.monotonic() - t0:.2f} s", flush=True)
    return out


class _Outcomes(dict):
    """{key: results}; a key whose job raised raises that exception when read."""

    def __getitem__(self, key):
        value = super().__getitem__(key)
        if isinstance(value, BaseException):
            raise AssertionError(f"job {key!r} failed: {value}") from value
        return value


def run_concurrently(jobs: dict) -> dict:
    """Several :func:`run_workers` jobs at once: ``jobs`` is ``{key: kwargs of run_workers}``;
    returns ``{key: [WorkerResult per rank]}`` (reading a key whose job raised raises it).  For
    jobs that mostly wait by design (a rank stopped for 10 s, a peer timeout) and have nothing
    to do with each other: each has its own rendezvous, job id and secret, so they overlap
    their waits instead of adding them up."""
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = {key: pool.submit(run_workers, **kw) for key, kw in jobs.items()}
        out = _Outcomes()
        for key, f in futures.items():
            try:
                out[key] = f.result()
            except BaseException as e:  # noqa: BLE001  (raised when that key is read)
                out[key] = e
        return out

"""Cluster state of the KungFu bridge: init/finalize, epochs, names, and elastic resizing.

Framework-free (numpy + ``sdp.api``); ``sdp_kungfu_bridge.python`` is its public face.

Epochs
======
The engine's world is fixed for the life of a ``sdp.engine.runtime.Runtime``, so a resize is
a new *epoch* of the job: every live worker shuts its runtime down and starts a new one for the
new cluster.  An epoch is numbered (``SDP_ELASTIC_EPOCH``, 0 for the workers ``sdprun`` starts
first) and has its own rendezvous server, which the launcher runs.  Everything the bridge keys on
the cluster (collective names, the model store's peer table) is reset at the start of an epoch,
so survivors and newly started workers agree on it.

Resize protocol (``resize(n)`` / ``resize()``)
=============================================
All current members call it at the same point of their program (it is a collective):

1. Target size.  ``resize(n)``: every rank's ``n`` is gathered; if they differ every rank raises
   ``ResizeError``.  ``resize()``: rank 0 reads the desired size from the config server
   (``SDP_CONFIG_SERVER``, HTTP GET, JSON with ``size`` or a KungFu-style ``Workers`` list) and
   broadcasts it.
2. Same size as now: nothing happens; every rank returns ``(False, False)``.
3. Commit.  Rank 0 POSTs ``{"size": n, "epoch": e}`` to the launcher's control endpoint
   (``SDP_ELASTIC_URL/resize``).  The launcher checks the slots, starts a rendezvous server for
   epoch ``e + 1`` of size ``n``, starts processes for the new ranks ``size .. n-1`` (with the
   ``SDP_*`` variables of the new epoch), records ``n`` as the desired size in its config server,
   and answers ``{"epoch": e + 1, "size": n, "rendezvous": "tcp://...", "ranks": [env, ...]}``.
   Rank 0 broadcasts the answer (or the error: then every rank raises ``ResizeError`` and
   the cluster is unchanged).
4. Switch.  Every member shuts its runtime down (the old ring is dissolved; ``shutdown`` waits for
   every peer's goodbye).  Ranks ``>= n`` are *detached*: they return ``(True, True)`` and should
   exit (``detached()`` is then true; collectives raise ``DetachedError``).  Ranks ``< n``
   keep their rank, set the ``SDP_*`` variables of the new epoch and call ``sdp.api.init()``, which
   meets the new workers at the new rendezvous; they return ``(True, False)``.
5. The program re-synchronises: rank 0 broadcasts its step counter and model (KungFu's elastic
   callback pattern); new workers do the same broadcast as their first collective.

The epoch switch (shut down, take the new epoch's ``SDP_*``, ``sdp.api.init()``) is
``sdp.elastic.enter_epoch``, the core Horovod Elastic uses too.

Every wait has a deadline: HTTP calls ``SDP_ELASTIC_HTTP_TIMEOUT`` seconds (default 30), the new
rendezvous ``SDP_START_TIMEOUT``.  Failures raise ``ElasticError`` subclasses.
"""
import hashlib
import itertools
import logging
import os
import socket
import threading
import time
from typing import List, Optional, Tuple

import numpy as np

from sdp import api, elastic
from sdp.common.config import cluster_size_of
from sdp.common.errors import NotInitializedError, SdpError
from sdp.common.reduce_ops import ReduceOp

log = logging.getLogger("sdp.kungfu")

EPOCH_ENV = elastic.EPOCH_ENV
CONTROL_ENV = elastic.CONTROL_ENV
CONFIG_ENV = "SDP_CONFIG_SERVER"
HTTP_TIMEOUT_ENV = "SDP_ELASTIC_HTTP_TIMEOUT"
NO_AUTO_INIT_ENVS = ("SDP_KUNGFU_NO_AUTO_INIT", "KUNGFU_DISABLE_AUTO_LOAD")


class ElasticError(SdpError):
    """Elastic resizing failed or is not available (no ``sdprun -w``, config server down...)."""


class ResizeError(ElasticError):
    """A resize could not be agreed or committed; the cluster is unchanged."""


class DetachedError(SdpError):
    """An operation needs cluster membership, but this worker was detached by ``resize``."""


_lock = threading.RLock()
_state = {
    "epoch": None,          # epoch of the current runtime
    "runtime": None,        # the sdp.api runtime the bridge set up for
    "detached": False,
    "finalized": False,
    "last": (0, 1, 0, 1),   # rank, size, local rank, local size (kept after detaching)
    "uid": None,
}
_names = {"counter": itertools.count()}


def _http_timeout() -> float:
    try:
        return float(os.environ.get(HTTP_TIMEOUT_ENV) or 30.0)
    except ValueError:
        return 30.0


# ---------------------------------------------------------------------------------- lifecycle


def auto_init_enabled() -> bool:
    return not any(os.environ.get(k, "") not in ("", "0") for k in NO_AUTO_INIT_ENVS)


def init() -> None:
    """Join the cluster described by the environment (idempotent, unlike ``sdp.api.init``).

    Adopts a runtime started elsewhere (``sdp.init()``); does nothing once detached."""
    with _lock:
        if _state["detached"]:
            return
        _state["finalized"] = False
        if not api.is_initialized():
            api.init()
        _setup_epoch()


def finalize() -> None:
    """Leave the cluster: shut the engine down (``sdp.api.shutdown``).  Idempotent."""
    with _lock:
        if api.is_initialized():
            _remember_topology()
        api.shutdown()
        _state["runtime"] = None
        _state["finalized"] = True


def _remember_topology() -> None:
    rt = api.runtime()
    t = rt.topology
    _state["last"] = (t.rank, t.size, t.local_rank, t.local_size)


def _setup_epoch() -> None:
    """Called with the runtime of a (new) epoch up: reset names, tell listeners (model store)."""
    rt = api.runtime()
    if _state["runtime"] is rt:
        return
    _state["runtime"] = rt
    _state["epoch"] = int(os.environ.get(EPOCH_ENV) or 0)
    _names["counter"] = itertools.count()
    _remember_topology()
    # Every member of the epoch gets here at the same point: exchange model-store addresses.
    from sdp_kungfu_bridge import _model_store
    _model_store.on_epoch(_state["epoch"], f"kf.store.addresses.{_state['epoch']}")


def ensure() -> None:
    """Make sure the bridge is set up for the current runtime (auto-init if needed)."""
    if _state["detached"]:
        raise DetachedError("this worker was detached from the cluster by resize(); it should exit")
    if _state["finalized"]:
        raise NotInitializedError("a KungFu operation after finalize() (call init() to rejoin)")
    if _state["runtime"] is None or _state["runtime"] is not api._runtime:
        init()


def epoch() -> int:
    ensure()
    return _state["epoch"]


def next_name(kind: str) -> str:
    """A collective name that matches across ranks: per epoch, from a counter reset each epoch
    (eager calls happen in the same order on every rank)."""
    return f"kf.{kind}.{_state['epoch']}.{next(_names['counter'])}"


# ------------------------------------------------------------------------------- cluster info


def detached() -> bool:
    return bool(_state["detached"])


def _topo_value(i: int) -> int:
    if _state["detached"] or _state["finalized"]:
        return _state["last"][i]
    ensure()
    t = api.runtime().topology
    return (t.rank, t.size, t.local_rank, t.local_size)[i]


def rank() -> int:
    return _topo_value(0)


def size() -> int:
    return _topo_value(1)


def local_rank() -> int:
    return _topo_value(2)


def local_size() -> int:
    return _topo_value(3)


def uid() -> int:
    """A 63-bit id of this process, stable for its life (KungFu derives it from IP and port)."""
    if _state["uid"] is None:
        seed = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}".encode()
        _state["uid"] = int.from_bytes(hashlib.sha256(seed).digest()[:8], "little") >> 1
    return _state["uid"]


def barrier() -> None:
    ensure()
    api.allreduce(np.zeros(1, np.int32), name=next_name("barrier"), op=ReduceOp.SUM)


def all_reduce_int_max(x: int) -> int:
    ensure()
    return int(api.allreduce(np.array(int(x), np.int64), name=next_name("all_reduce_int_max"),
                             op=ReduceOp.MAX))


# ------------------------------------------------------------------------------ config server


def _request(url: str, method: str = "GET", body=None) -> dict:
    """``sdp.elastic.request`` (signed towards sdprun's endpoint), with the bridge's errors."""
    try:
        return elastic.request(url, method, body, timeout=_http_timeout())
    except elastic.ElasticError as e:
        raise ElasticError(str(e)) from None


def config_server_url() -> Optional[str]:
    return os.environ.get(CONFIG_ENV) or os.environ.get("KUNGFU_CONFIG_SERVER") or None


def control_url() -> Optional[str]:
    return os.environ.get(CONTROL_ENV) or None


def _no_server(what: str) -> ElasticError:
    return ElasticError(
        f"{what} needs a config server: launch with 'sdprun -w [--builtin-config-port PORT]' "
        f"(or set {CONFIG_ENV}/{CONTROL_ENV})")


def fetch_desired_size() -> int:
    url = config_server_url()
    if not url:
        raise _no_server("resize() without a size")
    try:
        return cluster_size_of(_request(url))
    except ValueError as e:
        raise ElasticError(str(e)) from None


def propose_new_size(new_size: int) -> None:
    """Write ``new_size`` to the config server (no collective; workers pick it up at their next
    ``resize()``).  Raises ``ElasticError`` without a config server or on HTTP failure."""
    new_size = int(new_size)
    if new_size < 1:
        raise ValueError(f"cluster size must be at least 1, got {new_size}")
    url = config_server_url()
    if not url:
        raise _no_server("propose_new_size()")
    _request(url, "PUT", {"size": new_size})


# ------------------------------------------------------------------------------------- resize


def _broadcast_outcome(fn, name: str):
    """Run ``fn()`` on rank 0 and give every rank its value, or raise its error everywhere."""
    out = None
    if api.rank() == 0:
        try:
            out = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            out = ("error", f"{type(e).__name__}: {e}")
    out = api.broadcast_object(out, 0, name=name)
    if out[0] != "ok":
        raise ResizeError(out[1])
    return out[1]


def resize(n: Optional[int] = None) -> Tuple[bool, bool]:
    """Resize the cluster to ``n`` workers, or to the config server's size when ``n`` is None.

    A collective: every member calls it at the same point.  Returns ``(changed, detached)``.
    See the module docstring for the protocol."""
    with _lock:
        ensure()
        ep = _state["epoch"]
        cur, me = api.size(), api.rank()
        base = next_name("resize")
        if n is None:
            target = _broadcast_outcome(fetch_desired_size, f"{base}.target")
        else:
            target = int(n)
            every = api.allgather_object(target, name=f"{base}.consensus")
            if len(set(every)) != 1:
                raise ResizeError(f"ranks disagree on the new cluster size: {every} (by rank)")
        if target < 1:
            raise ResizeError(f"cluster size must be at least 1, got {target}")
        if target == cur:
            return False, False

        def commit():
            url = control_url()
            if not url:
                raise _no_server(f"resize({target})")
            return _request(url.rstrip("/") + "/resize", "POST", {"size": target, "epoch": ep})

        rec = _broadcast_outcome(commit, f"{base}.commit")
        return _switch(rec, me)


def _switch(rec: dict, me: int) -> Tuple[bool, bool]:
    new_size, new_epoch = int(rec["size"]), int(rec["epoch"])
    log.info("rank %d: cluster epoch %d -> %d, size %d -> %d", me, _state["epoch"], new_epoch,
             api.size(), new_size)
    _remember_topology()
    api.shutdown()
    _state["runtime"] = None
    if me >= new_size:
        _state["detached"] = True
        return True, True
    elastic.enter_epoch(rec["ranks"][me], rec["rendezvous"], new_epoch)  # the core shared with Horovod Elastic
    _setup_epoch()
    return True, False


def other_ranks() -> List[int]:
    me, n = rank(), size()
    return [r for r in range(n) if r != me]

"""Worker side of elastic jobs, framework-free: epochs, Horovod Elastic's state and ``run`` loop.

One elastic core serves Horovod Elastic (``sdprun --host-discovery-script``,
``sdp.launcher.elastic.HorovodElasticDriver``) and the KungFu bridge's resize (``sdprun -w``,
``sdp_kungfu_bridge._cluster``): the engine's world is fixed for the life of a
``Runtime``, so a job changes shape by starting a new *epoch*: every
member shuts its runtime down, takes the ``SDP_*`` variables of the new epoch from ``sdprun``'s
signed control endpoint (``SDP_ELASTIC_URL``), and calls ``sdp.api.init`` again, which meets
the other members (and newly started workers) at the epoch's own rendezvous.  A new runtime means
new ranks ``0..n-1``, a new topology, fresh engine caches and freshly made shared memory.

Horovod Elastic on top (mirrors ``horovod.common.elastic``):

* ``State`` / ``ObjectState``: ``commit()`` = ``save()`` + ``check_host_updates()``;
  ``restore()`` goes back to the last ``save()``; ``sync()`` gives every rank rank 0's state;
  ``register_reset_callbacks(fns)`` are called after every re-formation.
* ``run_fn``: the loop behind ``hvd.elastic.run``: ``sync()``, call the function; on
  ``HorovodInternalError`` (a collective failed, e.g. a peer died:
  ``PeerLostError``; not the ``ValueError`` kinds such as
  ``TensorMismatchError``, a bug that would fail again on every try, which
  propagate) ``restore()`` the last commit, re-form, ``sync()`` and call again; on ``HostsUpdatedInterrupt`` re-form without rollback
  (and without sync when hosts were only removed).  Each rank reports a recovery in one warning
  line (``collective failed (lost connection to rank 2: ...): rolling back ...``): inside the loop
  the transport's own error line about the lost peer is left out.
* Host changes: ``sdprun`` counts them (``hosts_version`` of ``GET /status``); at each
  ``commit()``/``check_host_updates()`` rank 0 reads the count and broadcasts it, so every rank
  raises ``HostsUpdatedInterrupt`` at the same commit.

Re-forming (``reset``): ``sdp.api.shutdown()``, then ``POST /join {"worker": id, "epoch": e}``
until ``sdprun`` answers with the next epoch (it waits until every live member asked, starts
workers for new slots, and starts the epoch's rendezvous).  Waits are bounded: each request by
``SDP_ELASTIC_HTTP_TIMEOUT`` (default 30 s), the whole wait by ``SDP_ELASTIC_TIMEOUT`` (default
600 s, set by ``--elastic-timeout``); then ``ElasticError``.  An answer ``{"stop": why}``
(the job ends: below ``--min-np``, ``--reset-limit`` reached) raises ``ElasticError`` too.
"""
import copy
import functools
import json
import logging
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable, Dict, List, Optional

from sdp import api
from sdp.common.errors import HorovodInternalError, HostsUpdatedInterrupt, PeerLostError, SdpError
from sdp.transport import security

log = logging.getLogger("sdp.elastic")

EPOCH_ENV = "SDP_ELASTIC_EPOCH"
CONTROL_ENV = "SDP_ELASTIC_URL"
WORKER_ENV = "SDP_ELASTIC_WORKER"       # the worker's id in sdprun (stable across epochs)
TIMEOUT_ENV = "SDP_ELASTIC_TIMEOUT"     # seconds a re-formation may take (--elastic-timeout)
HTTP_TIMEOUT_ENV = "SDP_ELASTIC_HTTP_TIMEOUT"
JOIN_POLL_S = 5.0                        # how long sdprun holds one /join request


class ElasticError(SdpError):
    """Elastic re-formation failed or is not available (no elastic ``sdprun``, the job stopped
    below ``--min-np``, ``--reset-limit`` reached, timeout)."""


def _float_env(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name) or default)
    except ValueError:
        return default


def control_url() -> Optional[str]:
    """``sdprun``'s control endpoint (``SDP_ELASTIC_URL``), or None outside an elastic job."""
    return os.environ.get(CONTROL_ENV) or None


def request(url: str, method: str = "GET", body=None, timeout: Optional[float] = None) -> dict:
    """An HTTP request with a JSON body and answer; requests to ``sdprun``'s own endpoint are
    signed with the job secret.  Raises ``ElasticError`` on HTTP or network failure."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    secret = security.secret_from_env()
    if secret and url.startswith(control_url() or "\0"):  # sdprun's own endpoint: the job's token
        u = urllib.parse.urlsplit(url)
        target = (u.path or "/") + (f"?{u.query}" if u.query else "")
        headers["Authorization"] = security.http_authorization(secret, method, target, data or b"")
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout or _float_env(HTTP_TIMEOUT_ENV, 30.0)) as resp:
            text = resp.read().decode()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        try:
            detail = json.loads(detail).get("error", detail)
        except ValueError:
            pass
        raise ElasticError(f"{method} {url} failed: HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ElasticError(f"{method} {url} failed: {e}") from None
    try:
        return json.loads(text) if text.strip() else {}
    except ValueError:
        raise ElasticError(f"{method} {url}: answer is not JSON: {text[:200]!r}") from None


def epoch() -> int:
    """The epoch this process's runtime belongs to (0 for the first workers)."""
    return int(os.environ.get(EPOCH_ENV) or 0)


def enter_epoch(rank_env: Dict[str, str], rendezvous: str, new_epoch: int) -> None:
    """Start the runtime of epoch ``new_epoch``: set its ``SDP_*`` variables (``rank_env``, the
    rendezvous address) and call ``sdp.api.init``.  The old runtime must be shut down."""
    os.environ.update({k: str(v) for k, v in rank_env.items()})
    os.environ["SDP_RENDEZVOUS_ADDR"] = rendezvous
    os.environ[EPOCH_ENV] = str(new_epoch)
    api.init()


HOSTS_POLL_S = 1.0  # sdprun runs the discovery script once a second: asking more often tells nothing new
_hosts_seen = {"at": -HOSTS_POLL_S, "version": 0, "url": None}


def hosts_version() -> int:
    """How many times ``sdprun`` saw the hosts change (0 outside a Horovod-elastic job); asks
    ``sdprun`` at most once per ``HOSTS_POLL_S`` seconds (a commit every batch then costs one
    broadcast, not an HTTP round trip: 4.7 -> 3.7 ms per commit with 2 ranks at load 7.4)."""
    url = control_url()
    if not url or not os.environ.get(WORKER_ENV):
        return 0
    now = time.monotonic()
    if _hosts_seen["url"] != url or now - _hosts_seen["at"] >= HOSTS_POLL_S:
        _hosts_seen.update(at=now, url=url,
                           version=int(request(url.rstrip("/") + "/status").get("hosts_version", 0)))
    return _hosts_seen["version"]


_LOST_RE = re.compile(r"lost connection to rank (\d{1,7})\b")
_lost_ranks = set()  # ranks of the current epoch a failed collective named (PeerLostError)


def note_lost(e: BaseException) -> None:
    """Remember the rank a ``PeerLostError`` names: the next
    ``reset`` tells ``sdprun``, which then stops that worker if it does not ask to re-form
    (a dead link or machine) instead of waiting for its ssh session to time out."""
    rank = getattr(e, "rank", None) if isinstance(e, PeerLostError) else None
    if rank is None:  # the same error wrapped by a framework (a TensorFlow op error)
        m = _LOST_RE.search(str(e))
        rank = int(m.group(1)) if m else None
    if isinstance(rank, int) and 0 <= rank < (1 << 20):
        _lost_ranks.add(rank)


def reset() -> None:
    """Leave the current epoch and join the next one (see the module docstring).  Raises
    ``ElasticError`` outside an elastic job, when ``sdprun`` stops the job, or on timeout;
    ``SystemExit(0)`` when ``sdprun`` lets this worker go (its host left the discovery output:
    the worker ends, as Horovod's do)."""
    url, worker = control_url(), os.environ.get(WORKER_ENV)
    if not url or worker is None:
        raise ElasticError("re-forming the job needs an elastic launch: sdprun --host-discovery-script ... "
                           f"({CONTROL_ENV}/{WORKER_ENV} are not set)")
    api.shutdown()
    ep = epoch()
    body = {"worker": int(worker), "epoch": ep}
    if _lost_ranks:
        body["lost"] = sorted(_lost_ranks)
    _lost_ranks.clear()
    deadline = time.monotonic() + _float_env(TIMEOUT_ENV, 600.0)
    while True:
        rec = request(url.rstrip("/") + "/join", "POST", body,
                      timeout=JOIN_POLL_S + _float_env(HTTP_TIMEOUT_ENV, 30.0))
        if "stop" in rec:
            raise ElasticError(f"sdprun ended the elastic job: {rec['stop']}")
        if "leave" in rec:
            log.info("worker %s leaves the job: %s", worker, rec["leave"])
            raise SystemExit(0)
        if "rendezvous" in rec:
            break
        if time.monotonic() > deadline:
            raise ElasticError(f"no new epoch after epoch {ep} within {TIMEOUT_ENV}="
                               f"{_float_env(TIMEOUT_ENV, 600.0):g} s")
    log.info("worker %s: epoch %d -> %d as rank %s of %s", worker, ep, rec["epoch"], rec["env"]["SDP_RANK"],
             rec["env"]["SDP_SIZE"])
    enter_epoch(rec["env"], rec["rendezvous"], int(rec["epoch"]))


# ------------------------------------------------------------------------------------- state


class State:
    """Horovod's elastic ``State``: what a job rolls back to and shares with new workers.

    ``bcast_object(obj, root_rank)`` and ``get_rank()`` are the collectives it uses (default:
    ``sdp.api.broadcast_object``, ``sdp.api.rank``).  Mirrors
    ``horovod.common.elastic.State``."""

    def __init__(self, bcast_object: Optional[Callable] = None, get_rank: Optional[Callable] = None):
        self._bcast_object = bcast_object or (lambda obj, root_rank=0: api.broadcast_object(obj, root_rank))
        self._rank = get_rank or api.rank
        self._reset_callbacks: List[Callable] = []
        self._hosts_version = None

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions (no arguments) to call after each re-formation of the job (e.g. to scale
        the learning rate by the new size)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Call the reset callbacks (the loop of ``run_fn`` does, after each re-formation)."""
        for cb in self._reset_callbacks:
            cb()

    def _host_baseline(self) -> None:
        v = hosts_version() if self._rank() == 0 else None
        self._hosts_version = self._bcast_object(v, 0)

    def commit(self) -> None:
        """``save()`` the state, then ``check_host_updates`` (may raise
        ``HostsUpdatedInterrupt``).  A collective: every rank calls it."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank when ``sdprun``
        saw the hosts change since the last check (rank 0 asks, then broadcasts; a collective)."""
        prev = self._hosts_version
        self._host_baseline()
        if prev is not None and self._hosts_version != prev:
            raise HostsUpdatedInterrupt(False)

    def save(self) -> None:
        """Keep the current state as the one ``restore`` goes back to (subclasses say what)."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the state of the last ``save`` (after a failed collective)."""
        raise NotImplementedError

    def sync(self) -> None:
        """Give every rank rank 0's state (a collective: every rank calls it)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Nothing here: Horovod's hook for subclasses, called when the job is reset."""


class ObjectState(State):
    """State of plain Python attributes given as keyword arguments (``state.epoch``, ``state.batch``
    ...): ``save`` deep-copies them, ``restore`` puts the copies back, ``sync`` broadcasts rank 0's
    values.  Mirrors ``horovod.common.elastic.ObjectState``."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        """Deep-copy the attributes as the state to go back to."""
        self._saved_state = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_state}

    def restore(self) -> None:
        """Set the attributes back to the copies of the last ``save``."""
        self._set_attrs()

    def sync(self) -> None:
        """Broadcast rank 0's saved attributes and set them on every rank (a collective)."""
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state, 0)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for k, v in self._saved_state.items():
            setattr(self, k, copy.deepcopy(v))


def _recoverable(e: BaseException) -> bool:
    """Whether a re-formation can help: an sdp error of the job (a lost peer, a timeout, a stall,
    a failed rendezvous), not a usage error (``ValueError`` kinds such as a tensor mismatch, which
    would fail again on every try) and not the elastic machinery's own ``ElasticError``."""
    return isinstance(e, HorovodInternalError) and not isinstance(e, (ElasticError, ValueError))


def _reform(reset_fn: Callable) -> None:
    """``reset_fn()`` until it succeeds: a member lost while the job re-forms (the new epoch's
    rendezvous or first collective fails) means one more re-formation.  ``sdprun`` bounds the
    tries (``--reset-limit``, ``--elastic-timeout``: then ``ElasticError``)."""
    while True:
        try:
            reset_fn()
            return
        except ElasticError:
            raise
        except HorovodInternalError as e:
            if not _recoverable(e):
                raise
            note_lost(e)
            log.warning("re-forming the job failed (%s); trying again", str(e).splitlines()[0][:300])


class _RecoveredLoss(logging.Filter):
    """On ``sdp.transport`` inside ``run_fn``: drops its "lost rank" error, which the
    rollback's warning repeats (one line per rank for a recovery)."""

    def filter(self, record):
        return not (record.levelno >= logging.ERROR and "lost rank" in record.getMessage())


_RECOVERED_LOSS = _RecoveredLoss()


def run_fn(func: Callable, reset_fn: Callable = reset, is_internal_error: Callable = None) -> Callable:
    """The loop of Horovod's ``hvd.elastic.run`` (see the module docstring): ``func(state, ...)``
    is called until it returns; ``is_internal_error(exc)`` may classify framework errors (e.g. a
    TensorFlow op error caused by a lost peer) as ``HorovodInternalError``."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        skip_sync = False
        logging.getLogger("sdp.transport").addFilter(_RECOVERED_LOSS)  # (once: a set of filters)
        while True:
            try:
                if not skip_sync:
                    state.sync()
                state._host_baseline()  # same collectives on survivors and new workers
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as e:
                log.info("hosts changed: re-forming the job without rollback")
                skip_sync = e.skip_sync
            except Exception as e:  # noqa: BLE001 - classified below
                if not (_recoverable(e) or (is_internal_error is not None and is_internal_error(e))):
                    raise
                log.warning("collective failed (%s): rolling back to the last commit and re-forming",
                            str(e).splitlines()[0][:300])
                note_lost(e)
                state.restore()
                skip_sync = False
            _reform(reset_fn)
            state.on_reset()

    return wrapper

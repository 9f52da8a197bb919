"""One-sided key-value transport: a rank serves named numpy arrays from a background thread on
its own ZeroMQ ROUTER socket, and peers fetch them with DEALER sockets, without the owner taking
part in the request (a slow or sleeping owner never stalls the requester).

This sits beside :mod:`sdp.transport.zmq_mesh` instead of on it: the mesh carries all-rank,
negotiated collectives, while a fetch is one-sided and asynchronous, answered while the owner
computes.  Used by the KungFu face's model store (``save_variable``/``request_variable``,
``PairAveragingOptimizer``).

Protocol (JSON headers, never pickle): a DEALER sends ``[{"id", "name", "version"}]``; the server
answers ``[{"id", "ok": true, "dtype", "shape", "version"}, payload]`` or
``[{"id", "ok": false, "error"}]``.  Replies carry the request id, so a late answer to a request
that timed out is dropped.  Every wait has a deadline (``SDP_STORE_TIMEOUT`` seconds, default 60):
:class:`StoreTimeoutError`.  Malformed or foreign requests are logged and dropped.

Security: servers and clients authenticate and encrypt with CURVE keys derived from the job secret
(:mod:`sdp.transport.security`; a model is bulk data, but a pull is one-sided and may go to any
peer at any time, so no single-use token could be handed over for it); a process without the
secret can neither connect nor read a variable.  A request is at most ``MAX_REQUEST_BYTES``.  The
server binds one given address, never ``*``/``0.0.0.0``.
"""
import collections
import itertools
import json
import logging
import os
import threading
import time
from typing import Dict, Optional, Tuple

import numpy as np
import zmq

from sdp.common.errors import SdpError
from sdp.transport import security

log = logging.getLogger("sdp.transport.store")

KEEP_VERSIONS = 8  # versions kept per name, besides the latest
MAX_REQUEST_BYTES = 64 * 1024  # a request is a small JSON object
TIMEOUT_ENV = "SDP_STORE_TIMEOUT"


class StoreError(SdpError):
    """A model-store request failed (unknown name or version, bad answer)."""


class StoreTimeoutError(StoreError, TimeoutError):
    """A peer's model store did not answer within the deadline (is the peer alive?)."""


def default_timeout() -> float:
    """Seconds a request waits for its answer: ``SDP_STORE_TIMEOUT``, default 60."""
    try:
        return float(os.environ.get(TIMEOUT_ENV) or 60.0)
    except ValueError:
        return 60.0


class _Entry:
    """The saved values of one name: the latest and a few recent versions."""

    def __init__(self):
        self.latest: Optional[Tuple[np.ndarray, Optional[int]]] = None
        self.versions: "collections.OrderedDict[int, np.ndarray]" = collections.OrderedDict()


def _job_secret(secret: Optional[str]) -> str:
    # a process alone (no secret in the environment) gets a random one: nobody else can connect
    return secret or security.secret_from_env() or security.new_secret()


class Server:
    """This process's store and the thread that serves it, at ``tcp://host:<free port>``
    (``address``).  ``host``: one local address (``*``/``0.0.0.0`` raise ``ValueError``);
    ``secret``: the job secret (default ``SDP_SECRET``/``SDP_SECRET_FILE``)."""

    def __init__(self, host: str, secret: Optional[str] = None):
        if host in ("*", "0.0.0.0", "::", "[::]", ""):
            raise ValueError(f"model store host {host!r} would listen on every interface; give one address")
        secret = _job_secret(secret)
        self._ctx = zmq.Context()
        self._gate = security.Gatekeeper(self._ctx, secret, "model store")
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        security.secure_server(self._sock, secret)
        # the slot policy (sdp.transport.guard): strangers never displace a peer's connection
        self._guard = self._gate.guard(self._sock)
        try:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError:
            self._guard.stop()
            self._sock.close(linger=0)
            self._gate.stop()
            self._ctx.term()
            raise
        self.address = f"tcp://{host}:{port}"
        self._data: Dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.served = 0
        self._thread = threading.Thread(target=self._serve, name="sdp-store", daemon=True)
        self._thread.start()

    def save(self, name: str, array, version: Optional[int] = None) -> None:
        """Keep a copy of ``array`` (any shape and dtype) as ``name``'s latest value and, if
        ``version`` is given, as that version (the last ``KEEP_VERSIONS`` are kept)."""
        arr = np.array(array, copy=True, order="C")  # stored arrays are never mutated
        with self._lock:
            e = self._data.setdefault(name, _Entry())
            e.latest = (arr, version)
            if version is not None:
                e.versions[int(version)] = arr
                while len(e.versions) > KEEP_VERSIONS:
                    e.versions.popitem(last=False)

    def get(self, name: str, version: Optional[int] = None) -> Tuple[np.ndarray, Optional[int]]:
        """``(array, version)`` saved as ``name`` (latest, or ``version``); the array is the
        store's own, not to be written.  Raises :class:`StoreError` for an unknown name/version."""
        with self._lock:
            e = self._data.get(name)
            if e is None or e.latest is None:
                raise StoreError(f"no variable named {name!r} has been saved (saved: {sorted(self._data)})")
            if version is None:
                return e.latest
            arr = e.versions.get(int(version))
            if arr is None:
                raise StoreError(f"version {version} of {name!r} is not in the store "
                                 f"(has versions {list(e.versions)})")
            return arr, int(version)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(100):
                    continue
                frames = self._sock.recv_multipart()
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise
            if len(frames) != 2:
                log.warning("model store: dropping malformed request (%d frames)", len(frames))
                continue
            ident = frames[0]
            try:
                req = json.loads(frames[1])
                rid, name, version = req["id"], str(req["name"]), req.get("version")
            except (ValueError, KeyError, TypeError):
                log.warning("model store: dropping foreign request %r", frames[1][:64])
                continue
            try:
                arr, ver = self.get(name, version)
            except StoreError as e:
                self._sock.send_multipart([ident, json.dumps({"id": rid, "ok": False, "error": str(e)}).encode()])
                continue
            head = {"id": rid, "ok": True, "dtype": arr.dtype.str, "shape": list(arr.shape), "version": ver}
            self.served += 1  # before the answer: a client that has it may read the count at once
            self._sock.send_multipart([ident, json.dumps(head).encode(), arr.reshape(-1).view(np.uint8)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._guard.stop()
        self._sock.close(linger=0)
        self._gate.stop()
        self._ctx.term()


class Client:
    """DEALER sockets to peers' stores, one per address, each used under its own lock.
    ``secret``: the job secret (default ``SDP_SECRET``/``SDP_SECRET_FILE``)."""

    def __init__(self, secret: Optional[str] = None):
        self._secret = _job_secret(secret)
        self._ctx = zmq.Context()
        self._socks: Dict[str, Tuple[zmq.Socket, threading.Lock]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def _socket(self, address: str):
        with self._lock:
            if address not in self._socks:
                s = self._ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                security.secure_client(s, self._secret)
                s.connect(address)
                self._socks[address] = (s, threading.Lock())
            return self._socks[address]

    def request(self, address: str, name: str, version: Optional[int] = None,
                timeout: Optional[float] = None, peer: str = "peer") -> Tuple[np.ndarray, Optional[int]]:
        """Fetch ``(array, version)`` of ``name`` (latest, or ``version``) from the server at
        ``address`` (``peer`` names it in errors).  Raises :class:`StoreTimeoutError` after
        ``timeout`` seconds (default :func:`default_timeout`), :class:`StoreError` for an error
        answer or a malformed one."""
        timeout = default_timeout() if timeout is None else timeout
        sock, lock = self._socket(address)
        rid = next(self._ids)
        deadline = time.monotonic() + timeout
        with lock:
            sock.send(json.dumps({"id": rid, "name": name, "version": version}).encode())
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000) + 1):
                    raise StoreTimeoutError(
                        f"{peer} ({address}) did not answer a request for {name!r} within {timeout:g} s")
                frames = sock.recv_multipart(copy=False)  # the payload is copied once, below
                try:
                    head = json.loads(frames[0].bytes)
                    if not isinstance(head, dict):
                        raise ValueError(f"header is a {type(head).__name__}")
                except ValueError as e:
                    raise StoreError(f"{peer} ({address}) sent a malformed answer ({e})") from None
                if head.get("id") != rid:
                    continue  # the late answer to an earlier request that timed out
                if not head.get("ok"):
                    raise StoreError(f"{peer}: {head.get('error')}")
                try:
                    payload = frames[1].buffer if len(frames) > 1 else b""
                    arr = np.frombuffer(payload, dtype=np.dtype(head["dtype"])).reshape(head["shape"])
                except (KeyError, TypeError, ValueError) as e:
                    raise StoreError(f"{peer} ({address}) sent a malformed array for {name!r} ({e!r})") from None
                return arr.copy(), head.get("version")

    def close(self) -> None:
        with self._lock:
            for s, _ in self._socks.values():
                s.close(linger=0)
            self._socks.clear()
        self._ctx.term()

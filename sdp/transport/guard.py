"""What a peer without the job secret can take from a listening socket, and the log of refusals.

ZeroMQ accepts every TCP connection to a bound socket and keeps it (one file descriptor) until the
ZMTP handshake, security included, finishes or fails.  An intruder who opens connections and then
says nothing held them for libzmq's default handshake interval of 30 s: 2,000 such connections took
a rank from 51 to 1,051 open files, and under ``ulimit -n 1024`` the training script then failed
with ``EMFILE``.  So every server socket of a job (mesh ROUTER, rendezvous, model store):

* has a handshake interval of ``HANDSHAKE_IVL_MS`` (3 s, ``ZMQ_HANDSHAKE_IVL``, set by
  :func:`sdp.transport.security.secure_server`): a connection that has not authenticated by then
  is closed by ZeroMQ;
* holds at most ``expected + PENDING_CAP`` accepted connections (``expected``: the connections
  the job itself makes to it, e.g. one per peer rank; ``PENDING_CAP`` = 32): a
  :class:`ConnectionGuard` thread reads ZeroMQ's ``EVENT_ACCEPTED`` (which carries the new
  descriptor) and shuts one beyond the cap down at once (``shutdown(2)``; ZeroMQ then closes it).
  So sdp's descriptors stay within a budget: per rank, its own sockets (two per peer: the DEALER
  and the accepted connection, one mapping per same-host peer's shared memory, ZeroMQ's
  internal pipes: 34 in all for a rank of a 2-rank job with TensorFlow not imported) plus at most
  ``PENDING_CAP`` strangers per listening socket once the guard has caught up; the rest of
  ``ulimit -n`` is the user's.  Measured (``tests/test_hostile.py``: 2,000 connections that
  never send a byte to each of a 2-rank job's 3 listening sockets, ranks and ``sdprun`` under
  ``ulimit -n 1024``, each rank holding 200 files at a time while training; 2-core host at load
  5-15): a rank peaked at 217-692 descriptors for milliseconds while ZeroMQ accepted faster than
  the guard (a Python thread) shut connections down, then held 34; the job ended with equal
  checksums.  On the code before, every connection stayed 30 s and the script died of
  ``EMFILE``.

Each refusal is logged with its source address (:class:`RefusalLog`): the first from an address
at once, with the reason; the others from it within ``SUMMARY_S`` (60 s) as one line at the end
of that interval, ``"N refused from ADDR in the last 60 s"``.  Reasons: a foreign CURVE key or a
wrong/spent PLAIN token (from the ZAP handler, :class:`sdp.transport.security.Gatekeeper`), over
the cap, or closed before authenticating (no greeting within the handshake interval, another
mechanism, not ZMTP at all).
"""
import collections
import logging
import re
import socket
import struct
import threading
import time
from typing import Callable, Dict, Optional

import zmq
from zmq.utils.monitor import recv_monitor_message

HANDSHAKE_IVL_MS = 3000  # ms an accepted connection may take to authenticate (libzmq's default: 30000)
PENDING_CAP = 32  # connections per listening socket beyond the ones the job makes itself
SUMMARY_S = 60.0  # seconds over which the refusals from one address are summed into one line
MAX_SOURCES = 1024  # addresses tracked at once; more are summed as "other addresses"
_OTHER = "other addresses"
UNKNOWN = "an unknown address (closed before its address was read)"

log = logging.getLogger("sdp.security")


class RefusalLog:
    """Rate-limited log of refused connections and requests, per source address: the first
    refusal from an address is logged at once with its reason; the rest within ``interval_s``
    become one summary line when :meth:`flush` finds that interval over.  Thread-safe."""

    def __init__(self, name: str, logger: logging.Logger = log, interval_s: Optional[float] = None):
        self.name = name
        self._log = logger
        self._interval = SUMMARY_S if interval_s is None else interval_s
        self._sources: Dict[str, list] = {}  # addr -> [window start, refused since the first line, last reason]
        self._lock = threading.Lock()
        self.total = 0

    def refused(self, addr: str, reason: str) -> None:
        addr = addr or "local"
        with self._lock:
            self.total += 1
            entry = self._sources.get(addr)
            if entry is None and len(self._sources) >= MAX_SOURCES:
                addr, entry = _OTHER, self._sources.get(_OTHER)
            if entry is not None:
                entry[1] += 1
                entry[2] = reason
                return
            self._sources[addr] = [time.monotonic(), 0, reason]
        self._log.warning("%s: refused a connection from %s: %s", self.name, addr, reason)

    def flush(self, now: Optional[float] = None) -> None:
        """Write the summary lines of the intervals that are over."""
        now = time.monotonic() if now is None else now
        lines = []
        with self._lock:
            for addr, (start, n, reason) in list(self._sources.items()):
                if now - start >= self._interval:
                    del self._sources[addr]
                    if n:
                        lines.append((n, addr, reason))
        for n, addr, reason in lines:
            self._log.warning("%s: %d refused from %s in the last %g s (last: %s)", self.name, n, addr,
                              self._interval, reason)


_ZAP_LOCAL = re.compile(r"^localhost:(\d+):(\d+):(\d+)$")


def source_name(zap_address: str) -> str:
    """A ZAP request's address as :func:`_peer_address` names it: the IP address, or for a Unix
    socket (libzmq sends ``localhost:uid:gid:pid``) ``"local pid P (uid U)"``."""
    m = _ZAP_LOCAL.match(zap_address)
    return f"local pid {m.group(3)} (uid {m.group(1)})" if m else zap_address


def _peer_address(fd: int) -> str:
    """The source address of accepted connection ``fd``: its IP address, or for a Unix socket
    the other process (``"local pid P (uid U)"``, from ``SO_PEERCRED``)."""
    s = None
    try:
        s = socket.socket(fileno=fd)
        if s.family == socket.AF_UNIX:
            pid, uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            return f"local pid {pid} (uid {uid})"
        peer = s.getpeername()
        return peer[0] if isinstance(peer, tuple) else ""
    except (OSError, AttributeError, struct.error):
        return UNKNOWN  # ZeroMQ closed it before this thread got to it
    finally:
        if s is not None:
            s.detach()  # the descriptor stays ZeroMQ's


def _shutdown(fd: int) -> None:
    s = None
    try:
        s = socket.socket(fileno=fd)
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        if s is not None:
            s.detach()


class ConnectionGuard:
    """Caps the accepted connections of server socket ``sock`` at ``expected() + PENDING_CAP`` and
    logs the ones that never authenticated, in a daemon thread reading a socket monitor (a socket
    has one monitor: this is it).  ``outcome(addr)`` (the ZAP handler's
    :meth:`~sdp.transport.security.Gatekeeper.take_outcome`) says whether a connection from
    ``addr`` was judged, so that it is not logged twice.  Call :meth:`stop` (from the thread that
    owns ``sock``) before closing it."""

    EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED

    def __init__(self, sock, refusals: RefusalLog, expected: Callable[[], int],
                 outcome: Optional[Callable[[str], Optional[str]]] = None, cap: int = PENDING_CAP):
        self._sock = sock
        self.refusals = refusals
        self._expected = expected
        self._outcome = outcome or (lambda addr: None)
        self._cap = cap
        self._open: Dict[int, tuple] = {}  # fd -> (source address, accepted at)
        self._shut = set()  # fds shut down here (logged already)
        self.peak = 0  # most accepted connections open at once
        self.capped = 0  # connections shut down for the cap
        self._mon = sock.get_monitor_socket(self.EVENTS)
        self._thread = threading.Thread(target=self._run, name="sdp-guard", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        try:
            self._sock.disable_monitor()  # the thread gets EVENT_MONITOR_STOPPED and ends
        except zmq.ZMQError:
            pass
        self._thread.join(timeout=2)

    def _run(self) -> None:
        mon = self._mon
        try:
            while True:
                if mon.poll(1000):
                    ev = recv_monitor_message(mon)
                    if ev["event"] == zmq.EVENT_MONITOR_STOPPED:
                        return
                    if ev["event"] == zmq.EVENT_ACCEPTED:
                        self._accepted(ev["value"], ev["endpoint"])
                    elif ev["event"] == zmq.EVENT_DISCONNECTED:
                        self._disconnected(ev["value"])
                self.refusals.flush()
        except zmq.ZMQError:  # the context is ending
            return
        finally:
            mon.close(linger=0)

    def _accepted(self, fd: int, endpoint: bytes) -> None:
        addr = _peer_address(fd)
        self._open[fd] = (addr, time.monotonic())
        self.peak = max(self.peak, len(self._open))
        cap = self._expected() + self._cap
        if len(self._open) > cap:
            _shutdown(fd)
            self._shut.add(fd)
            self.capped += 1
            self.refusals.refused(addr, f"{len(self._open) - 1} connections to {endpoint.decode(errors='replace')} "
                                        f"already open (at most {cap}: the job's own + {self._cap} "
                                        f"still authenticating)")

    def _disconnected(self, fd: int) -> None:
        addr, since = self._open.pop(fd, ("", 0.0))
        if fd in self._shut:
            self._shut.discard(fd)
            return
        judged = self._outcome(addr)  # "ok" / "refused": the ZAP handler saw it (and logged a refusal)
        if judged is None and time.monotonic() - since < HANDSHAKE_IVL_MS / 1000 + 0.5:
            self.refusals.refused(addr, f"closed before authenticating (nothing, another protocol or "
                                        f"security mechanism, or not within {HANDSHAKE_IVL_MS / 1000:g} s)")


class Outcomes:
    """The ZAP handler's verdicts per source address, waiting for the guard to match them with
    a closed connection (bounded: oldest dropped)."""

    def __init__(self, per_source: int = 64):
        self._by_addr: Dict[str, collections.deque] = {}
        self._per_source = per_source
        self._lock = threading.Lock()

    def add(self, addr: str, verdict: str) -> None:
        with self._lock:
            q = self._by_addr.get(addr)
            if q is None:
                if len(self._by_addr) >= MAX_SOURCES:
                    self._by_addr.pop(next(iter(self._by_addr)))
                q = self._by_addr[addr] = collections.deque(maxlen=self._per_source)
            q.append(verdict)

    def take(self, addr: str) -> Optional[str]:
        with self._lock:
            q = self._by_addr.get(addr)
            if not q:
                return None
            v = q.popleft()
            if not q:
                del self._by_addr[addr]
            return v

"""What a peer without the job secret can take from a listening socket, and the log of refusals.

An unauthenticated connection costs its listener a descriptor, and on a socket that caps them, a
slot a genuine peer may need.  So every listening socket of a job (mesh ROUTER, rendezvous, model
store here; the leaders' link, :mod:`sdp.transport.tcp_link`, and ``sdprun``'s elastic endpoint,
:mod:`sdp.launcher.elastic`, with the same :class:`Slots`) follows one **slot policy** (issue 53):

* a connection holds a slot only until it authenticates, and for ``HANDSHAKE_IVL_MS`` (3 s) at
  most: on ZeroMQ sockets ``ZMQ_HANDSHAKE_IVL`` (set by :func:`sdp.transport.security.secure_server`;
  libzmq's default is 30 s) closes it, elsewhere the listener does;
* at most ``PENDING_CAP`` (32) connections wait to authenticate at once.  A newcomer is always
  let in; when that makes one too many, the listener drops the connection that has sent nothing
  (an idle one before one that speaks), of the source address holding the most, the oldest
  first (:meth:`Slots.admit`).  A genuine peer speaks at once and authenticates in milliseconds,
  so strangers holding idle connections, however many and from wherever, displace only each
  other; a stranger never makes the genuine peer the one refused.  (Before, the newcomer was
  refused: 32 idle connections made the genuine leader's the one shut out.)
* on a Unix socket (the mesh's abstract ``ipc://@sdp-...`` sockets, which have no file
  permissions) a connection from another user is dropped at accept, logged with its pid and
  uid (``SO_PEERCRED``).

ZeroMQ accepts connections itself and tells nothing of one before its handshake, so on its
sockets a :class:`ConnectionGuard` thread reads the socket monitor's ``EVENT_ACCEPTED`` (which
carries the descriptor), asks the kernel whether the connection has sent anything
(``TCP_INFO``'s byte count; ZeroMQ reads everything at once) and ``shutdown(2)``s the one the
policy drops (ZeroMQ then closes it).  A connection older than the handshake interval has
authenticated (ZeroMQ would have closed it) and holds no slot.  So sdp's descriptors stay within
a budget: per rank, its own sockets plus at most ``PENDING_CAP`` strangers per listening socket
once the guard has caught up.  Measured (``tests/test_hostile.py``: 2,000 connections that never
send a byte to each of a 2-rank job's 3 listening sockets, ranks and ``sdprun`` under ``ulimit -n
1024``, each rank holding 200 files at a time while training; 2-core host at load 5-15): a rank
peaked at 217-692 descriptors for milliseconds while ZeroMQ accepted faster than the guard (a
Python thread) shut connections down, then held 34; the job ended with equal checksums.

Each refusal is logged with its source address (:class:`RefusalLog`): the first from an address
at once, with the reason; the others from it within ``SUMMARY_S`` (10 s) as one line at the end
of that interval, ``"N refused from ADDR in the last 10 s"``.  Reasons: a foreign CURVE key or a
wrong/spent PLAIN token (from the ZAP handler, :class:`sdp.transport.security.Gatekeeper`),
dropped for a newer connection, another user, or closed before authenticating (no greeting
within the handshake interval, another mechanism, not ZMTP at all).
"""
import collections
import os
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
PENDING_CAP = 32  # connections per listening socket waiting to authenticate at once
SUMMARY_S = 10.0  # seconds over which the refusals from one address are summed into one line
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


def peer_credentials(sock: socket.socket) -> Optional[tuple]:
    """``(pid, uid)`` of the process at the other end of Unix socket ``sock`` (``SO_PEERCRED``),
    or None (not a Unix socket, or gone)."""
    try:
        if sock.family != socket.AF_UNIX:
            return None
        pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return pid, uid
    except (OSError, AttributeError, struct.error):
        return None


def local_name(pid: int, uid: int) -> str:
    """The source name of a local process: ``"local pid P (uid U)"``."""
    return f"local pid {pid} (uid {uid})"


def foreign_user(sock: socket.socket) -> Optional[str]:
    """The source name of the process at the other end of Unix socket ``sock`` when it runs as
    another user than this process (to be dropped at once), else None."""
    cred = peer_credentials(sock)
    return local_name(*cred) if cred is not None and cred[1] != os.geteuid() else None


def received_bytes(sock: socket.socket) -> int:
    """Bytes TCP connection ``sock`` has received so far, read or not (``TCP_INFO``'s
    ``tcpi_bytes_received``, Linux 4.1+); 1 where unknown (another family or system), so such
    connections count as speaking."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        return struct.unpack_from("<Q", info, 128)[0] if len(info) >= 136 else 1
    except (OSError, AttributeError, struct.error):
        return 1


class Slots:
    """The pre-authentication slots of one listening socket (the policy of the module docstring):
    at most ``cap`` connections wait to authenticate at once; :meth:`admit` always takes the
    newcomer in and names the ones to drop for it.  Keys are whatever the listener tells its
    connections apart by (a descriptor, a socket).  Thread-safe."""

    def __init__(self, cap: int = PENDING_CAP):
        self.cap = cap
        self._pending: Dict[object, tuple] = {}  # key -> (source, since)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._pending)

    def admit(self, key, source: str, spoke: Callable[[object], bool] = lambda key: True,
              now: Optional[float] = None) -> list:
        """Take connection ``key`` from ``source`` into a slot; ``[(key, source), ...]`` of the
        connections to close for it (removed here): while over ``cap``, of those waiting other
        than ``key``, one that has sent nothing (``spoke(key)`` false) before one that has, of
        the source holding the most slots, the oldest first."""
        now = time.monotonic() if now is None else now
        out = []
        with self._lock:
            self._pending[key] = (source, now)
            if len(self._pending) <= self.cap:
                return out
            count = collections.Counter(src for src, _ in self._pending.values())
            order = sorted((bool(spoke(k)), -count[src], since, i, k)
                           for i, (k, (src, since)) in enumerate(self._pending.items()) if k is not key)
            for *_, k in order[:len(self._pending) - self.cap]:
                out.append((k, self._pending.pop(k)[0]))
        return out

    def done(self, key) -> None:
        """Connection ``key`` authenticated or closed: its slot is free."""
        with self._lock:
            self._pending.pop(key, None)

    def expired(self, age_s: float, now: Optional[float] = None) -> list:
        """``[(key, source), ...]`` of the connections that have waited ``age_s`` or longer
        (removed here)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [k for k, (_, since) in self._pending.items() if now - since >= age_s]
            return [(k, self._pending.pop(k)[0]) for k in old]


def _peer_address(sock: socket.socket) -> str:
    """The source address of accepted connection ``sock``: its IP address, or for a Unix socket
    the other process (``"local pid P (uid U)"``, from ``SO_PEERCRED``)."""
    try:
        cred = peer_credentials(sock)
        if cred is not None:
            return local_name(*cred)
        peer = sock.getpeername()
        return peer[0] if isinstance(peer, tuple) else ""
    except (OSError, AttributeError):
        return UNKNOWN  # ZeroMQ closed it before this thread got to it


def _borrow(fd: int) -> Optional[socket.socket]:
    """A socket object over ZeroMQ's descriptor ``fd`` (to be ``detach()``ed, never closed)."""
    try:
        return socket.socket(fileno=fd)
    except OSError:
        return None


class ConnectionGuard:
    """Applies the slot policy (:class:`Slots`) to server socket ``sock``'s connections and logs
    the ones that never authenticated, in a daemon thread reading a socket monitor (a socket has
    one monitor: this is it).  ``outcome(addr)`` (the ZAP handler's
    :meth:`~sdp.transport.security.Gatekeeper.take_outcome`) says whether a connection from
    ``addr`` was judged, so that it is not logged twice.  Call :meth:`stop` (from the thread that
    owns ``sock``) before closing it."""

    EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED

    def __init__(self, sock, refusals: RefusalLog, outcome: Optional[Callable[[str], Optional[str]]] = None,
                 cap: int = PENDING_CAP):
        self._sock = sock
        self.refusals = refusals
        self._outcome = outcome or (lambda addr: None)
        self._slots = Slots(cap)
        self._open: Dict[int, tuple] = {}  # fd -> (source address, accepted at, the socket's inode)
        self._shut = set()  # fds shut down here (logged already)
        self.peak = 0  # most accepted connections open at once
        self.capped = 0  # connections shut down for the policy (dropped for a newer one, another user)
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

    def _spoke(self, fd: int) -> bool:
        s = _borrow(fd)
        if s is None:
            return False
        try:
            return s.family != socket.AF_INET and s.family != socket.AF_INET6 or received_bytes(s) > 0
        finally:
            s.detach()

    def _shutdown(self, fd: int, addr: str, reason: str) -> None:
        """Shut connection ``fd`` down, unless ZeroMQ closed it and the number is now another
        connection's (this thread reads the events after the fact: compared by inode)."""
        try:
            if os.fstat(fd).st_ino != self._open.get(fd, (None, None, -1))[2]:
                return
        except OSError:
            return
        s = _borrow(fd)
        if s is not None:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            finally:
                s.detach()
        self._shut.add(fd)
        self.capped += 1
        self.refusals.refused(addr, reason)

    def _accepted(self, fd: int, endpoint: bytes) -> None:
        s = _borrow(fd)
        if s is None:  # ZeroMQ closed it already (its DISCONNECTED event follows): logged as unknown
            self._open[fd] = (UNKNOWN, time.monotonic(), -1)
            return
        try:
            addr, stranger = _peer_address(s), foreign_user(s)
        finally:
            s.detach()
        try:
            ino = os.fstat(fd).st_ino
        except OSError:
            addr, ino = UNKNOWN, -1
        self._open[fd] = (addr, time.monotonic(), ino)
        if ino == -1:
            return
        self.peak = max(self.peak, len(self._open))
        where = endpoint.decode(errors="replace")
        if stranger is not None:
            self._shutdown(fd, stranger, f"another user connected to {where}: dropped at once")
            return
        self._slots.expired(HANDSHAKE_IVL_MS / 1000 + 0.5)  # (authenticated: ZeroMQ closes the rest by then)
        for victim, src in self._slots.admit(fd, addr, self._spoke):
            self._shutdown(victim, src, f"dropped for a newer connection to {where}: {self._slots.cap} were "
                                        f"already waiting to authenticate (the oldest idle one goes)")

    def _disconnected(self, fd: int) -> None:
        addr, since, _ = self._open.pop(fd, ("", 0.0, 0))
        self._slots.done(fd)
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

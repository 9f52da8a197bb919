"""The host leaders' link of :mod:`sdp.engine.hostlink` over plain TCP sockets (issues 30, 53).

Between two hosts a ZeroMQ message crosses four threads (the sender's, its I/O thread, the
receiver's I/O thread, the receiver): two more wake-ups per hop than TCP itself, which cost a
synchronous 1 KB allreduce on 2 x 2 emulated hosts most of its time.  Here each host leader sends
on a TCP connection of its own to every other leader from the calling thread, and reads the ones
they opened to it, so a hop is one ``sendmsg`` and one ``recv_into``.

* **Setup** (in :class:`sdp.transport.zmq_mesh.Mesh`): every rank listens on one port of its
  mesh address (never all interfaces) before rendezvous, as who leads a host is known only after
  it, and publishes, in the CURVE-protected rendezvous table, one random 128-bit token per peer
  rank (:meth:`LeaderLink.offer`).  A thread accepts (so leaders never wait on each other to
  accept); after rendezvous each leader connects to every other leader and presents
  ``(MAGIC, its rank, n, HMAC-SHA256(token, ...)[:16])``: the ``n``-th single-use proof derived
  from the token the other leader issued it, accepted only for an ``n`` above the last one
  accepted from that rank (a replayed handshake is refused; the token itself never travels).
  Non-leaders stop listening then; leaders listen for the rest of the job, for repairs.
* **Strangers** meet the slot policy of :mod:`sdp.transport.guard` (:class:`~sdp.transport.guard.Slots`):
  a connection that has not presented its proof within :data:`HANDSHAKE_S` is closed; of more
  than :data:`~sdp.transport.guard.PENDING_CAP` waiting, the oldest idle one is dropped, never
  the newcomer; each logged with its source address (:class:`~sdp.transport.guard.RefusalLog`).
* **Frames**: a 4-byte little-endian length, then that many bytes; a length over
  :data:`MAX_FRAME_BYTES` is logged and closes that connection, which is then repaired as a reset
  one (the byte stream cannot be followed past it).
* Each connection carries one direction: a leader writes only the ones it opened and reads only
  the ones it accepted.  Sends block (``TCP_NODELAY``; a host that stops acknowledging ends the
  connection after ``TCP_USER_TIMEOUT``).
* **Repair**: a connection that fails (a send's error, end of stream or an error where nothing is
  ever read, a reset, an oversized frame) is replaced: its writer connects again with the next
  proof and first resends the frames its caller may not have seen read (``history(dst)``: a
  leader's last two messages, which the reader's position filter dedups); its reader adopts the
  new connection when it arrives.  Repair needs nothing but the listener, the tokens from the
  rendezvous and the peer's process, so when the writer cannot reconnect within :data:`REPAIR_S`
  (the peer's host or process is gone, or a firewall now refuses) or :data:`REPAIR` is off,
  ``on_failure(rank, reason)`` (the mesh: the rank is lost, every rank raises
  :class:`~sdp.common.errors.PeerLostError` naming the link and the host).  A reader waits for its
  writer (which may just be late); a writer that died is the mesh's to report.
  Payloads travel in the clear, as on the mesh by default; with ``SDP_ENCRYPT=1`` there is no link
  (those allreduces go through the engine, encrypted).
"""
import hashlib
import hmac
import logging
import secrets
import select
import selectors
import socket
import struct
import threading
import time
from typing import Callable, Dict, List, Optional

from sdp.common import errors
from sdp.transport.guard import PENDING_CAP, RefusalLog, Slots, received_bytes

log = logging.getLogger("sdp.transport")

MAGIC = b"SDPK"
TOKEN_BYTES = 16  # 128 random bits per (issuer, peer); proofs are derived from them
HANDSHAKE_S = 3.0  # seconds a connection may take to present its proof (ZMQ_HANDSHAKE_IVL here)
MAX_FRAME_BYTES = 256 << 10  # bytes: the largest frame a leader reads
USER_TIMEOUT_MS = 5000  # TCP_USER_TIMEOUT (ms): unacknowledged bytes this long end a connection (also the mesh's)
REPAIR_S = 5.0  # seconds a failed connection may take to be replaced before its peer counts as lost
REPAIR = True  # False: a failed connection is not replaced (tests of the failure path)
CONNECT_S = 1.0  # seconds one connection attempt may take
RETRY_S = 0.05  # seconds between attempts
_HELLO = struct.Struct("<4sIQ16s")
_LEN = struct.Struct("<I")


def _proof(token: bytes, src: int, dst: int, n: int) -> bytes:
    return hmac.new(token, MAGIC + struct.pack("<IIQ", src, dst, n), hashlib.sha256).digest()[:16]


class _Incoming:
    """An accepted, authenticated connection from leader ``src`` and its partial frames."""

    def __init__(self, src: int, sock: socket.socket):
        self.src, self.sock = src, sock
        self.buf = bytearray(_LEN.size + MAX_FRAME_BYTES)
        self.view = memoryview(self.buf)
        self.have = 0


def _tune(s: socket.socket) -> None:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)


class LeaderLink:
    """One rank's end of the leaders' link (see the module docstring): listening on ``ip``
    (a numeric IPv4 or IPv6 address) from construction until :meth:`close`.
    ``on_failure(rank, reason)`` is called (once) when a connection cannot be repaired;
    ``history(dst)`` gives the frames to resend to ``dst`` on a new connection."""

    def __init__(self, ip: str, rank: int, on_failure: Optional[Callable[[int, str], None]] = None):
        self.rank = rank
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        self._listener: Optional[socket.socket] = socket.create_server((ip, 0), family=family, backlog=128)
        self._listener.setblocking(False)
        self.address = [ip, self._listener.getsockname()[1]]
        self._tokens: Dict[int, bytes] = {}  # issued by this rank, by peer
        self._seen: Dict[int, int] = {}  # peer -> the last proof number accepted from it
        self._theirs: Dict[int, bytes] = {}  # issued to this rank, by leader
        self._sent_n: Dict[int, int] = {}  # leader -> the last proof number presented to it
        self._addr: Dict[int, tuple] = {}
        self._hosts: Dict[int, str] = {}
        self._lock = threading.Lock()  # held for each use of a socket, and to close them
        #: authenticated connections (source, socket) from the acceptor thread, taken in by the
        #: link's users (:meth:`_take_arrived`): the acceptor never waits for the link's lock,
        #: which a caller waiting in recv() takes again at once
        self._arrived: List[tuple] = []
        self._arrival = threading.Condition()
        self._out: Dict[int, socket.socket] = {}
        self._in: Dict[int, _Incoming] = {}  # by descriptor
        self._poll = select.poll()
        self._out_fds: Dict[int, int] = {}  # descriptor of a connection this rank writes -> its leader
        self._broken: Dict[tuple, tuple] = {}  # (("out"|"in"), leader) -> (since, cause): being repaired
        self._next_try: Dict[int, float] = {}  # leader -> when its connection may be tried again
        self._refusals = RefusalLog(f"rank {rank} (leaders' link)")
        self._leaders: List[int] = []
        self.on_failure = on_failure
        self.history: Callable[[int], list] = lambda dst: []
        self.failed: Optional[str] = None
        self.repairs = 0  # connections replaced
        self.repair_s: List[float] = []  # seconds each repair took (from the failure seen to the resend)
        #: ``(out fds, in fds)`` while every connection is open and no frame is partly read here
        #: (see :meth:`hold`), else None; changed only under the link's lock
        self.direct: Optional[tuple] = None
        self._stop = threading.Event()
        self._acceptor = threading.Thread(target=self._serve, name="sdp-link-accept", daemon=True)
        self._acceptor.start()

    def offer(self, size: int) -> Dict[str, str]:
        """The tokens (hex) this rank issues, one for each other rank of a job of ``size``, for
        its rendezvous entry."""
        with self._arrival:
            self._tokens = {r: secrets.token_bytes(TOKEN_BYTES) for r in range(size) if r != self.rank}
        return {str(r): t.hex() for r, t in self._tokens.items()}

    # -- setup ------------------------------------------------------------------------------
    def open(self, leaders: List[int], entries: Dict[int, dict], deadline: float) -> None:
        """Connect to every other leader in ``leaders`` (rendezvous ``entries`` by rank: its
        ``link_addr``, ``link_tokens`` and ``host``) and wait for theirs (accepted in a thread).
        Raises :class:`~sdp.common.errors.CollectiveTimeoutError` naming the leaders not connected
        by ``deadline`` (``time.monotonic()``), ``OSError`` when a leader cannot be reached."""
        others = [q for q in leaders if q != self.rank]
        for q in others:
            self._addr[q] = (entries[q]["link_addr"][0], int(entries[q]["link_addr"][1]))
            self._theirs[q] = bytes.fromhex(entries[q]["link_tokens"][str(self.rank)])
            self._hosts[q] = str(entries[q].get("host", "?"))
        for q in others:
            s = self._connect(q, max(0.1, deadline - time.monotonic()))
            with self._lock:
                self._add_out(q, s)
        while True:
            with self._lock:
                self._take_arrived()
                missing = [q for q in others if not self._has_in(q)]
                if not missing:
                    self._leaders = list(leaders)
                    self._set_direct()
                    return
            left = deadline - time.monotonic()
            if left <= 0:
                raise errors.CollectiveTimeoutError(
                    f"rank {self.rank}: host leaders {missing} did not join the leaders' link")
            with self._arrival:
                if not self._arrived:
                    self._arrival.wait(min(left, 0.1))

    def _connect(self, q: int, timeout_s: float) -> socket.socket:
        """A new connection to leader ``q``, its next proof presented."""
        s = socket.create_connection(self._addr[q], timeout=timeout_s)
        try:
            s.settimeout(None)
            _tune(s)
            n = self._sent_n[q] = self._sent_n.get(q, -1) + 1
            s.sendall(_HELLO.pack(MAGIC, self.rank, n, _proof(self._theirs[q], self.rank, q, n)))
        except OSError:
            s.close()
            raise
        return s

    def _has_in(self, q: int) -> bool:
        return any(c.src == q for c in self._in.values())

    def _add_out(self, q: int, s: socket.socket) -> None:
        """(Holding the lock.)"""
        self._out[q] = s
        self._out_fds[s.fileno()] = q
        self._poll.register(s.fileno(), select.POLLIN)  # (never readable but at its end or an error)

    # -- the acceptor thread ----------------------------------------------------------------
    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        slots = Slots(PENDING_CAP)
        pending: Dict[socket.socket, list] = {}  # -> [bytes so far, source]

        def drop(conn, reason):
            sel.unregister(conn)
            slots.done(conn)
            self._refusals.refused(pending.pop(conn)[1], reason)
            conn.close()
        try:
            while not self._stop.is_set():
                for conn, _ in slots.expired(HANDSHAKE_S):
                    drop(conn, f"no proof within {HANDSHAKE_S:g} s")
                for key, _ in sel.select(0.1):
                    if key.fileobj is self._listener:
                        try:
                            conn, addr = self._listener.accept()
                        except (BlockingIOError, InterruptedError):
                            continue
                        except OSError:  # (closed)
                            return
                        conn.setblocking(False)
                        pending[conn] = [b"", addr[0]]
                        sel.register(conn, selectors.EVENT_READ)
                        for victim, _ in slots.admit(conn, addr[0], lambda c: pending[c][0] or received_bytes(c)):
                            drop(victim, f"dropped for a newer connection: {PENDING_CAP} were already waiting "
                                         f"to authenticate (the oldest idle one goes)")
                        continue
                    conn, p = key.fileobj, pending[key.fileobj]
                    try:
                        chunk = conn.recv(_HELLO.size - len(p[0]))
                    except OSError:
                        chunk = b""
                    if not chunk:
                        drop(conn, "closed before authenticating")
                        continue
                    p[0] += chunk
                    if len(p[0]) < _HELLO.size:
                        continue
                    if not self._authentic(p[0]):
                        drop(conn, "a wrong, spent or unknown leader's proof")
                        continue
                    sel.unregister(conn)
                    slots.done(conn)
                    del pending[conn]
                    with self._arrival:
                        self._arrived.append((_HELLO.unpack(p[0])[1], conn))
                        self._arrival.notify_all()
                self._refusals.flush()
        finally:
            for conn in list(pending):
                conn.close()
            sel.close()
            self._refusals.flush(float("inf"))

    def _authentic(self, hello: bytes) -> bool:
        magic, src, n, proof = _HELLO.unpack(hello)
        with self._arrival:  # (not the link's lock, which callers hold in turn)
            token = self._tokens.get(src) if magic == MAGIC else None
            if token is None or n <= self._seen.get(src, -1):
                return False
            if not hmac.compare_digest(proof, _proof(token, src, self.rank, n)):
                return False
            self._seen[src] = n  # (single use: this proof and every earlier one are spent)
            return True

    def _take_arrived(self) -> None:
        """(Holding the lock.) The connections the acceptor authenticated, each replacing any from
        its leader before it."""
        with self._arrival:
            arrived, self._arrived = self._arrived, []
        for src, conn in arrived:
            conn.setblocking(True)
            _tune(conn)
            if self._stop.is_set():
                conn.close()
                continue
            for fd in [fd for fd, c in self._in.items() if c.src == src]:
                self._drop(fd)
            self._in[conn.fileno()] = _Incoming(src, conn)
            self._poll.register(conn.fileno(), select.POLLIN)
            broken = self._broken.pop(("in", src), None)
            if broken is not None:
                self._repaired(src, "from", broken)
            if self._leaders:
                self._set_direct()

    # -- use ----------------------------------------------------------------------------------
    def send(self, dst: int, body) -> None:
        """Send ``body`` (bytes-like, at most :data:`MAX_FRAME_BYTES`) to leader ``dst`` as one
        frame; a failed connection is repaired (see the module docstring)."""
        with self._lock:
            s = self._out.get(dst)
            if s is None:
                if dst in self._addr:  # (a leader's connection being repaired; else no link to it)
                    self._repair_out(dst)
                return
            head = _LEN.pack(len(body))
            try:
                sent = s.sendmsg([head, body])
                if sent < len(head) + len(body):
                    s.sendall((head + bytes(body))[sent:])
            except OSError as e:
                self._lose_out(dst, f"a send failed: {e}")
                self._repair_out(dst)

    def recv(self, timeout_ms: float) -> list:
        """``[(source rank, [frame bytes]), ...]``: the whole frames that arrived, waiting up to
        ``timeout_ms`` for data (``[]`` at once once closed).  Repairs what failed meanwhile."""
        out: list = []
        with self._lock:
            if self._broken:
                self._repair_all()
            if self._stop.is_set():
                return out
            if self._arrived:
                self._take_arrived()
            for fd, _ in self._poll.poll(timeout_ms):
                q = self._out_fds.get(fd)
                if q is not None:  # (a connection this rank writes: readable only at its end)
                    self._lose_out(q, "closed or reset by the other end")
                    self._repair_out(q)
                    continue
                c = self._in.get(fd)
                if c is None:
                    continue
                try:
                    n = c.sock.recv_into(c.view[c.have:])
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as e:
                    self._lose_in(fd, f"a read failed: {e}")
                    continue
                if n == 0:
                    self._lose_in(fd, "closed by the other end")
                    continue
                c.have += n
                self._frames(fd, c, out)
            self._set_direct()
        return out

    def hold(self) -> Optional[tuple]:
        """Take the link (as :meth:`send` and :meth:`recv` do, until :meth:`release`) and give
        :attr:`direct`: the descriptors of the connections to every other leader, and of theirs
        in the leaders' order (-1 for this rank), for a caller that writes whole frames and reads
        only whole ones (``sdp/engine/cc/link_now.c``); None, not taking it, when a connection is
        closed or a frame is partly read here."""
        self._lock.acquire()
        if self.direct is None:
            self._lock.release()
        return self.direct

    def release(self) -> None:
        """Let go of the link :meth:`hold` took."""
        self._lock.release()

    def _set_direct(self) -> None:
        """(Holding the lock.) :attr:`direct` as the connections now are."""
        ins = {c.src: fd for fd, c in self._in.items() if c.have == 0}
        others = [q for q in self._leaders if q != self.rank]
        ok = others and len(ins) == len(self._in) == len(others) and all(q in ins and q in self._out for q in others)
        self.direct = ((tuple(self._out[q].fileno() for q in others),
                        tuple(-1 if q == self.rank else ins[q] for q in self._leaders)) if ok else None)

    def _frames(self, fd: int, c: _Incoming, out: list) -> None:
        at = 0
        while c.have - at >= _LEN.size:
            (n,) = _LEN.unpack_from(c.buf, at)
            if n > MAX_FRAME_BYTES:
                log.warning("rank %d: a frame of %d bytes from leader %d on the leaders' link (at most %d); "
                            "closing that connection", self.rank, n, c.src, MAX_FRAME_BYTES)
                self._lose_in(fd, f"a frame of {n} bytes (at most {MAX_FRAME_BYTES})")
                return
            if c.have - at - _LEN.size < n:
                break
            out.append((c.src, [bytes(c.view[at + _LEN.size:at + _LEN.size + n])]))
            at += _LEN.size + n
        rest = c.have - at
        if at and rest:
            c.buf[:rest] = c.view[at:c.have].tobytes()
        c.have = rest

    # -- failures and repairs (holding the lock) ------------------------------------------
    def _lose_out(self, q: int, cause: str) -> None:
        s = self._out.pop(q, None)
        if s is not None:
            self._out_fds.pop(s.fileno(), None)
            self._poll.unregister(s.fileno())
            s.close()
            self.direct = None
        if ("out", q) not in self._broken:  # (a new failure: tried at once)
            self._next_try.pop(q, None)
            self._broken[("out", q)] = (time.monotonic(), cause)

    def _lose_in(self, fd: int, cause: str) -> None:
        src = self._in[fd].src
        self._drop(fd)
        self._broken.setdefault(("in", src), (time.monotonic(), cause))
        if not REPAIR:
            self._fail(src, cause)

    def _repair_out(self, q: int) -> None:
        """Connect to leader ``q`` again and resend what it may have lost, or fail past
        :data:`REPAIR_S`."""
        since, cause = self._broken.get(("out", q), (time.monotonic(), "no connection"))
        if self.failed is not None or self._stop.is_set() or q in self._out or \
                time.monotonic() < self._next_try.get(q, 0.0):
            return
        if not REPAIR:
            self._fail(q, cause)
            return
        self._next_try[q] = time.monotonic() + RETRY_S
        try:
            s = self._connect(q, min(CONNECT_S, max(0.05, since + REPAIR_S - time.monotonic())))
            for body in self.history(q):
                s.sendall(_LEN.pack(len(body)) + bytes(body))
        except OSError as e:
            if time.monotonic() - since >= REPAIR_S:
                self._fail(q, f"{cause}; reconnecting: {e}")
            return
        self._add_out(q, s)
        self._repaired(q, "to", self._broken.pop(("out", q), (since, cause)))

    def _repair_all(self) -> None:
        """Reconnect what this leader writes.  (What it reads its writer reconnects; a writer that
        cannot, or whose process or host is gone, fails the job itself or through the mesh: a
        reader cannot tell a lost connection from a peer that is just late.)"""
        for way, q in list(self._broken):
            if way == "out":
                self._repair_out(q)

    def _repaired(self, q: int, way: str, broken: tuple) -> None:
        took = time.monotonic() - broken[0]
        self.repairs += 1
        self.repair_s.append(took)
        log.warning("rank %d: the leaders' link %s rank %d (host %s) failed (%s); reconnected in %.0f ms",
                    self.rank, way, q, self._hosts.get(q, "?"), broken[1], took * 1000)

    def _fail(self, q: int, cause: str) -> None:
        if self.failed is not None:
            return
        self.failed = (f"the leaders' link with rank {q} on host {self._hosts.get(q, '?')} failed ({cause})"
                       + ("" if REPAIR else " and repair is off"))
        log.error("rank %d: %s", self.rank, self.failed)
        if self.on_failure is not None:
            self.on_failure(q, self.failed)

    def _drop(self, fd: int) -> None:
        c = self._in.pop(fd)
        self._poll.unregister(fd)
        c.sock.close()
        self.direct = None

    def close(self) -> None:
        """Close every socket and stop listening (waits for a :meth:`recv` in another thread:
        ``timeout_ms`` at most)."""
        self._stop.set()
        self._acceptor.join(timeout=2)
        with self._lock:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            for fd in list(self._in):
                self._drop(fd)
            for s in list(self._out.values()) + [conn for _, conn in self._arrived]:
                s.close()
            self._out, self._out_fds, self._broken, self._arrived = {}, {}, {}, []
            self._tokens = {}
            self.direct = None

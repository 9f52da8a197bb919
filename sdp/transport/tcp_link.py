"""The host leaders' link of :mod:`sdp.engine.hostlink` over plain TCP sockets (issue 30).

Between two hosts a ZeroMQ message crosses four threads (the sender's, its I/O thread, the
receiver's I/O thread, the receiver): two more wake-ups per hop than TCP itself, which cost a
synchronous 1 KB allreduce on 2 x 2 emulated hosts most of its time.  Here each host leader sends
on a TCP connection of its own to every other leader from the calling thread, and reads the ones
they opened to it, so a hop is one ``sendmsg`` and one ``recv_into``.

* **Setup** (in :class:`sdp.transport.zmq_mesh.Mesh`): every rank listens on one port of its
  mesh address (never all interfaces) before rendezvous, as who leads a host is known only after
  it, and publishes, in the CURVE-protected rendezvous table, one random 128-bit token per peer
  rank (:meth:`LeaderLink.offer`).  After rendezvous each leader connects to every other leader
  and presents ``(MAGIC, its rank, the token that leader issued to it)``, then accepts the
  connections of the others; a token is spent on use (a replayed handshake is refused).  A
  connection that presents anything else, or nothing within :data:`HANDSHAKE_S`, is closed and
  logged with its source address (:class:`sdp.transport.guard.RefusalLog`); at most
  :data:`PENDING_CAP` wait to authenticate at once.  Then the listener closes: a running job
  listens on no link port.  Payloads travel in the clear, as on the mesh by default; with
  ``SDP_ENCRYPT=1`` there is no link (those allreduces go through the engine, encrypted).
* **Frames**: a 4-byte little-endian length, then that many bytes; a length over
  :data:`MAX_FRAME_BYTES` is logged, and that connection is closed (the byte stream cannot be
  followed past it); its sender's later calls wait as for a silent peer (a stall, then
  :class:`~sdp.common.errors.StallError`).
* Each connection carries one direction: a leader writes only the ones it opened and reads only
  the ones it accepted.  Sends block (``TCP_NODELAY``; a host that stops acknowledging ends the
  connection after ``TCP_USER_TIMEOUT``); a send on a closed connection is dropped, as the
  caller's wait then meets the lost peer through the mesh.
"""
import hmac
import logging
import secrets
import select
import selectors
import socket
import struct
import threading
import time
from typing import Dict, List, Optional

from sdp.common import errors
from sdp.transport.guard import RefusalLog

log = logging.getLogger("sdp.transport")

MAGIC = b"SDPK"
TOKEN_BYTES = 16  # 128 random bits, single use
HANDSHAKE_S = 3.0  # seconds a connection may take to present its token (ZMQ_HANDSHAKE_IVL here)
PENDING_CAP = 32  # connections waiting to authenticate at once; more are closed
MAX_FRAME_BYTES = 256 << 10  # bytes: the largest frame a leader reads
USER_TIMEOUT_MS = 5000  # TCP_USER_TIMEOUT (ms): unacknowledged bytes this long end a connection (also the mesh's)
_HELLO = struct.Struct("<4sI16s")
_LEN = struct.Struct("<I")


class _Incoming:
    """An accepted, authenticated connection from leader ``src`` and its partial frames."""

    def __init__(self, src: int, sock: socket.socket):
        self.src, self.sock = src, sock
        self.buf = bytearray(_LEN.size + MAX_FRAME_BYTES)
        self.view = memoryview(self.buf)
        self.have = 0


class LeaderLink:
    """One rank's end of the leaders' link (see the module docstring): listening on ``ip``
    (a numeric IPv4 or IPv6 address) from construction until :meth:`open` or :meth:`close`."""

    def __init__(self, ip: str, rank: int):
        self.rank = rank
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        self._listener: Optional[socket.socket] = socket.create_server((ip, 0), family=family, backlog=PENDING_CAP)
        self.address = [ip, self._listener.getsockname()[1]]
        self._tokens: Dict[int, bytes] = {}
        self._lock = threading.Lock()  # held for each use of a socket, and to close them
        self._out: Dict[int, socket.socket] = {}
        self._in: Dict[int, _Incoming] = {}  # by descriptor
        self._poll = select.poll()
        self._refusals = RefusalLog(f"rank {rank} (leaders' link)")
        self._leaders: List[int] = []
        #: ``(out fds, in fds)`` while every connection is open and no frame is partly read here
        #: (see :meth:`hold`), else None; changed only under the link's lock
        self.direct: Optional[tuple] = None

    def offer(self, size: int) -> Dict[str, str]:
        """The tokens (hex) this rank issues, one for each other rank of a job of ``size``, for
        its rendezvous entry."""
        self._tokens = {r: secrets.token_bytes(TOKEN_BYTES) for r in range(size) if r != self.rank}
        return {str(r): t.hex() for r, t in self._tokens.items()}

    def open(self, leaders: List[int], entries: Dict[int, dict], deadline: float) -> None:
        """Connect to every other leader in ``leaders`` (rendezvous ``entries`` by rank: its
        ``link_addr`` and ``link_tokens``) and accept theirs, then stop listening.  Raises
        :class:`~sdp.common.errors.CollectiveTimeoutError` naming the leaders not connected by
        ``deadline`` (``time.monotonic()``), ``OSError`` when a leader cannot be reached."""
        others = [q for q in leaders if q != self.rank]
        for q in others:
            ip, port = entries[q]["link_addr"]
            s = socket.create_connection((ip, int(port)), timeout=max(0.1, deadline - time.monotonic()))
            s.settimeout(None)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if hasattr(socket, "TCP_USER_TIMEOUT"):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)
            s.sendall(_HELLO.pack(MAGIC, self.rank, bytes.fromhex(entries[q]["link_tokens"][str(self.rank)])))
            self._out[q] = s
        try:
            self._accept(set(others), deadline)
        finally:
            self._stop_listening()
        with self._lock:
            self._leaders = list(leaders)
            self._set_direct()

    def _accept(self, want: set, deadline: float) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        pending: Dict[socket.socket, list] = {}  # -> [accepted at, bytes so far, source]

        def drop(conn, reason):
            sel.unregister(conn)
            self._refusals.refused(pending.pop(conn)[2], reason)
            conn.close()
        try:
            while want:
                now = time.monotonic()
                if now >= deadline:
                    raise errors.CollectiveTimeoutError(
                        f"rank {self.rank}: host leaders {sorted(want)} did not join the leaders' link")
                for conn in [c for c, p in pending.items() if now - p[0] >= HANDSHAKE_S]:
                    drop(conn, f"no token within {HANDSHAKE_S:g} s")
                for key, _ in sel.select(min(0.1, deadline - now)):
                    if key.fileobj is self._listener:
                        conn, addr = self._listener.accept()
                        if len(pending) >= PENDING_CAP:
                            self._refusals.refused(addr[0], f"over {PENDING_CAP} connections authenticating")
                            conn.close()
                            continue
                        conn.setblocking(False)
                        pending[conn] = [time.monotonic(), b"", addr[0]]
                        sel.register(conn, selectors.EVENT_READ)
                        continue
                    conn, p = key.fileobj, pending[key.fileobj]
                    try:
                        chunk = conn.recv(_HELLO.size - len(p[1]))
                    except OSError:
                        chunk = b""
                    if not chunk:
                        drop(conn, "closed before authenticating")
                        continue
                    p[1] += chunk
                    if len(p[1]) < _HELLO.size:
                        continue
                    magic, src, token = _HELLO.unpack(p[1])
                    want_token = self._tokens.get(src) if magic == MAGIC and src in want else None
                    if want_token is None or not hmac.compare_digest(token, want_token):
                        drop(conn, "a wrong, spent or unknown leader's token")
                        continue
                    del self._tokens[src]  # single use
                    sel.unregister(conn)
                    del pending[conn]
                    want.discard(src)
                    self._in[conn.fileno()] = _Incoming(src, conn)
                    self._poll.register(conn.fileno(), select.POLLIN)
        finally:
            for conn in list(pending):
                conn.close()
            sel.close()
            self._refusals.flush(float("inf"))  # (the summaries: nothing listens after this)

    def _stop_listening(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            self._tokens = {}

    def send(self, dst: int, body) -> None:
        """Send ``body`` (bytes-like, at most :data:`MAX_FRAME_BYTES`) to leader ``dst`` as one
        frame; nothing when the connection is gone (see the module docstring)."""
        with self._lock:
            s = self._out.get(dst)
            if s is None:
                return
            head = _LEN.pack(len(body))
            try:
                sent = s.sendmsg([head, body])
                if sent < len(head) + len(body):
                    s.sendall((head + bytes(body))[sent:])
            except OSError as e:
                log.debug("rank %d: the leaders' link to rank %d is gone (%s)", self.rank, dst, e)
                del self._out[dst]
                s.close()
                self._set_direct()

    def recv(self, timeout_ms: float) -> list:
        """``[(source rank, [frame bytes]), ...]``: the whole frames that arrived, waiting up to
        ``timeout_ms`` for data (``[]`` at once once closed)."""
        out: list = []
        with self._lock:
            if not self._in:
                return out
            for fd, _ in self._poll.poll(timeout_ms):
                c = self._in.get(fd)
                if c is None:
                    continue
                try:
                    n = c.sock.recv_into(c.view[c.have:])
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    n = 0
                if n == 0:
                    log.debug("rank %d: leader %d closed the leaders' link", self.rank, c.src)
                    self._drop(fd)
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

    def _set_direct(self) -> None:
        """(Holding the lock.) :attr:`direct` as the connections now are."""
        ins = {c.src: fd for fd, c in self._in.items() if c.have == 0}
        others = [q for q in self._leaders if q != self.rank]
        ok = others and len(ins) == len(self._in) == len(others) and all(q in ins and q in self._out for q in others)
        self.direct = ((tuple(self._out[q].fileno() for q in others),
                        tuple(-1 if q == self.rank else ins[q] for q in self._leaders)) if ok else None)

    def release(self) -> None:
        """Let go of the link :meth:`hold` took."""
        self._lock.release()

    def _frames(self, fd: int, c: _Incoming, out: list) -> None:
        at = 0
        while c.have - at >= _LEN.size:
            (n,) = _LEN.unpack_from(c.buf, at)
            if n > MAX_FRAME_BYTES:
                log.warning("rank %d: a frame of %d bytes from leader %d on the leaders' link (at most %d); "
                            "closing that connection", self.rank, n, c.src, MAX_FRAME_BYTES)
                self._drop(fd)
                return
            if c.have - at - _LEN.size < n:
                break
            out.append((c.src, [bytes(c.view[at + _LEN.size:at + _LEN.size + n])]))
            at += _LEN.size + n
        rest = c.have - at
        if at and rest:
            c.buf[:rest] = c.view[at:c.have].tobytes()
        c.have = rest

    def _drop(self, fd: int) -> None:
        c = self._in.pop(fd)
        self._poll.unregister(fd)
        c.sock.close()
        self.direct = None

    def close(self) -> None:
        """Close every socket (waits for a :meth:`recv` in another thread: ``timeout_ms`` at most)."""
        with self._lock:
            self._stop_listening()
            for fd in list(self._in):
                self._drop(fd)
            for s in self._out.values():
                s.close()
            self._out = {}
            self.direct = None

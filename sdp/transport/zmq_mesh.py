"""The peer mesh: one ROUTER socket per rank for receiving, one DEALER per peer for sending.

Messages are multipart ``[header, payload...]``; ``header`` is ``MAGIC kind(u8) aux(u32) seq(u64)``.
Payloads of large messages are sent zero-copy (``copy=False``) and tracked, so a caller can
wait until ZeroMQ no longer reads a buffer before reusing it.  Messages from one peer arrive in
order; the mesh demultiplexes them into per-(peer, kind) inboxes.

Peer loss.  Three cases, told apart by what is seen (socket monitors on the DEALERs report
``EVENT_DISCONNECTED``; a dropped peer is lost after ``LOSS_GRACE_S``, or at once after its BYE):

* **A process dies** (crash, ``kill -9``, OOM killer): its kernel closes its sockets, the
  connection ends at once, and its peers raise :class:`PeerLostError` within ~1 s; on the same
  host, where ``/proc`` shows the process gone, after ``DEAD_GRACE_S`` (0.1 s: whatever it sent
  has reached this host's socket buffers by then).
* **A link or host goes away** (``ip link set ... down``, power loss): nothing closes anything,
  but ZeroMQ's heartbeat PINGs (every ``HEARTBEAT_IVL_MS``) stay unacknowledged by the peer's
  kernel, and ``TCP_USER_TIMEOUT`` (ZeroMQ's ``TCP_MAXRT``, ``LINK_TIMEOUT_MS``) closes the
  connection: lost within ~7 s (1 s to the next PING + 5 s + ``LOSS_GRACE_S``).
* **A process is alive but silent** (``SIGSTOP``, a debugger, heavy swapping; a Python GC pause
  or a long numpy call does not count: ZeroMQ's I/O thread runs without the GIL): its kernel
  still acknowledges every byte, so only the heartbeat notices, after ``SDP_PEER_TIMEOUT``
  seconds (default 30; 0: never) without a PONG: "no message from rank 1 for 30 s: stopped, hung
  or unreachable".  A shorter stop is survived: the collective just resumes.  On the same host
  (ipc) the peer's state is read from ``/proc/<pid>/stat`` (its pid comes from rendezvous) to say
  which it is.

So a cut link is lost in seconds while a stopped rank gets ``SDP_PEER_TIMEOUT``: the two are told
apart by whether the peer's kernel still answers, not by one timeout serving both.  The error
says which case was seen: on the same host from ``/proc``; between hosts from ZeroMQ's immediate
redial (accepted: alive but silent; refused, confirmed by one TCP probe with ``ECONNREFUSED``:
died; neither: its host stopped answering).

Every blocking wait has a deadline (``SDP_TIMEOUT``).  Foreign or malformed messages are logged and
dropped; the ROUTER refuses (``MAXMSGSIZE``) any frame larger than the biggest legitimate one
(a DATA segment of ``SDP_SEGMENT_BYTES``, at least ``SMALL_FRAME``, plus ``CTRL_HEADROOM`` for
control messages) before ZeroMQ allocates it, and closes that connection.
"""
import collections
import errno
import json
import logging
import os
import re
import socket
import struct
import sys
import tempfile
import time
from typing import Dict, List, Optional

import zmq
from zmq.utils.monitor import recv_monitor_message

from sdp.common.errors import CollectiveTimeoutError, PeerLostError, ProtocolError, SdpError
from sdp.common.config import Config
from sdp.common.network import bind_address
from sdp.transport import rendezvous, security, shm, shm_ctrl, tcp_link
from sdp.transport.shm import process_state

log = logging.getLogger("sdp.transport")

MAGIC = b"SDP1"
HEADER = struct.Struct("<4sBIQ")
# message kinds
HELLO, CTRL, DATA, BYE, SYNC, ABORT, P2P = 1, 2, 3, 4, 5, 6, 7  # (P2P: sdp.engine.p2p's send/recv)
BYE_WAIT_S = 0.05  # seconds a closing rank waits for the BYEs of peers that are closing too
COPY_BELOW = 64 * 1024  # bytes: smaller payloads are copied (cheaper than tracking)
TRACKER_SLICE_S = 0.05  # seconds between checks for lost peers while a sent buffer is still held
LOSS_GRACE_S = 1.0  # seconds a dropped peer's other connection may still deliver its last messages
DEAD_GRACE_S = 0.1  # the same for a same-host peer whose process is gone (its kernel has sent it all)
HEARTBEAT_IVL_MS = 1000  # ZeroMQ PING to every peer this often (ms)
LINK_TIMEOUT_MS = tcp_link.USER_TIMEOUT_MS  # TCP: bytes unacknowledged this long (link down, host gone) end the connection
SMALL_FRAME = 64 * 1024  # bytes: collectives send buffers up to this in one frame (recursive doubling)
CTRL_HEADROOM = 16 << 20  # bytes: room for control messages (a request naming ~100,000 new tensors)


class Mesh:
    """Sockets to every peer of a job of ``topology.size`` ranks.

    ``timeout_s`` (seconds) bounds every receive; ``peer_timeout_s`` (default ``SDP_PEER_TIMEOUT``)
    is how long a live peer may answer nothing before it is lost; ``segment_bytes`` (default
    ``SDP_SEGMENT_BYTES``) bounds the frames accepted (see the module docstring).  Raises
    :class:`PeerLostError` when a peer that a wait depends on is lost (module docstring),
    :class:`CollectiveTimeoutError` when a deadline passes,
    :class:`~sdp.transport.security.SecretError` when ``size > 1`` and no job secret is set.

    Security: the ROUTER binds to :func:`sdp.common.network.bind_address` (``SDP_IFACE``, or the
    interface towards the rendezvous; never ``*``) and an ipc socket (Linux: abstract, no file, so
    nothing is left however the rank ends; elsewhere in a 0700 directory); every
    connection is authenticated with the job secret, encrypted too when ``encrypt`` (default:
    ``SDP_ENCRYPT``); see :mod:`sdp.transport.security`.
    """

    def __init__(self, topology, timeout_s: float = 300.0, start_timeout_s: float = 60.0,
                 shm_slab_bytes: int = 32 << 20, shm_pool_bytes: int = 0, encrypt: Optional[bool] = None,
                 peer_timeout_s: Optional[float] = None, segment_bytes: Optional[int] = None,
                 bell: Optional[tuple] = None, link: bool = False):
        self.rank = topology.rank
        self.size = topology.size
        self.timeout_s = timeout_s
        self._secret = security.require_secret(self.size)
        cfg = Config.from_env() if None in (encrypt, peer_timeout_s, segment_bytes) else None
        self.encrypt = cfg.encrypt if encrypt is None else bool(encrypt)
        self.peer_timeout_s = cfg.peer_timeout_s if peer_timeout_s is None else float(peer_timeout_s)
        segment_bytes = cfg.segment_bytes if segment_bytes is None else int(segment_bytes)
        #: bytes: the largest frame the ROUTER accepts; ZeroMQ drops the connection of a bigger one
        self.max_frame_bytes = max(segment_bytes, SMALL_FRAME) + CTRL_HEADROOM
        self.ctx = zmq.Context(io_threads=1)
        self._gate = security.Gatekeeper(self.ctx, self._secret, f"rank {self.rank}") if self.size > 1 else None
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.RCVHWM, 0)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.RCVBUF, 4 << 20)
        self.router.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        self._guard = None
        if self._gate is not None:
            security.secure_server(self.router, self._secret, self.encrypt)
            # the slot policy (sdp.transport.guard); refusals logged with their source address
            self._guard = self._gate.guard(self.router)
        job = os.environ.get("SDP_JOB_ID") or os.urandom(6).hex()
        self._ipc_dir = None
        if sys.platform.startswith("linux"):  # abstract socket: no file, gone with the process
            ipc = f"ipc://@sdp-{job}-{self.rank}-{os.urandom(8).hex()}"
        else:
            self._ipc_dir = tempfile.mkdtemp(prefix=f"sdp-{job}-{self.rank}-")
            ipc = f"ipc://{self._ipc_dir}/r.sock"
        self.router.bind(ipc)
        ip = bind_address(topology.rendezvous_addr) if topology.size > 1 else "127.0.0.1"
        tcp_port = self.router.bind_to_random_port(f"tcp://{ip}") if topology.size > 1 else 0
        self.endpoints = {"ipc": ipc, "tcp": f"tcp://{ip}:{tcp_port}"}
        #: the host leaders' link (:mod:`sdp.engine.hostlink`) over TCP (:mod:`sdp.transport.tcp_link`):
        #: made on every rank (who leads a host is known after rendezvous), closed where unused;
        #: none when encrypting
        self.link: Optional[tcp_link.LeaderLink] = None
        self.link_on = False
        if link and self._gate is not None and not self.encrypt:
            self.link = tcp_link.LeaderLink(ip, self.rank, self._link_failed)
        self.peers: List[dict] = []
        self.dealers: Dict[int, zmq.Socket] = {}
        self.monitors: Dict[zmq.Socket, int] = {}
        self._ident_to_rank: Dict[bytes, int] = {}
        self.inbox = collections.defaultdict(collections.deque)  # (src, kind) -> deque of (aux, seq, frames)
        self.lost: Dict[int, str] = {}
        #: (rank, reason) of leaders' link connections that could not be repaired (from the
        #: caller's thread), made losses by pump() in the engine's
        self.link_lost: collections.deque = collections.deque()
        self._suspects: Dict[int, float] = {}  # rank -> when its connection dropped (see _confirm_losses)
        self._pids: Dict[int, int] = {}  # same-host peer rank -> its pid (from rendezvous)
        self._redial: Dict[int, str] = {}  # suspect rank -> how ZeroMQ's reconnection went (_loss_reason)
        self.departed = set()  # ranks that said BYE
        self.stopping = False  # set by the engine's shutdown(): waits end at once
        self.aborted: Dict[int, dict] = {}  # rank -> {"lost": rank or None, "err": str} it failed with
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.shm = None  # SharedSegments when every rank is on this host
        self.host_shm = None  # else SharedSegments of this host's ranks, when it has several
        #: shm_ctrl.ControlRings when this host's ranks share memory: control messages between
        #: them skip ZeroMQ
        self.ctrl: Optional[shm_ctrl.ControlRings] = None
        self._bell = bell  # (read fd, write fd) of the pipe the owner's thread polls (its doorbell)
        self._quiet_fds = {bell[0]} if bell is not None else set()  # ready: no socket to read
        self._job = job
        if self.size > 1:
            own = None
            if shm_slab_bytes > 0 and shm.available():
                rings = self.size if bell is not None and shm_ctrl.usable(self.size) else 0
                try:
                    own = self.shm = shm.SharedSegments(job, self.rank, shm_slab_bytes, shm_pool_bytes, rings)
                except OSError as e:
                    log.warning("rank %d: no shared memory (%s); same-host traffic goes over ZeroMQ",
                                self.rank, e)
            try:
                self._connect(topology, start_timeout_s)
            except BaseException:
                shm.remove_orphans(job)  # of same-host ranks killed in start-up: the job is failing
                raise
            finally:
                if own is not None:
                    own.unlink()  # every peer has mapped it (or never will)

    # -- setup ---------------------------------------------------------------------------
    def _connect(self, topology, start_timeout_s: float) -> None:
        info = {"rank": self.rank, "size": self.size, "host": topology.hostname, "pid": os.getpid(),
                "endpoints": self.endpoints, "shm": self.shm.path if self.shm else None}
        if self.shm is not None and self.shm.rings:
            info["bell"] = shm_ctrl.bell_path(self._bell[1])
        if not self.encrypt:  # one single-use token per peer (see sdp.transport.security)
            info["tokens"] = {str(r): self._gate.issue_token(str(r)) for r in range(self.size) if r != self.rank}
        if self.link is not None:  # (a rank that cannot take the link's shared memory: off everywhere)
            info["link"] = bool(self.shm is not None and self.shm.lane_bytes and shm_ctrl.STORES_ORDERED)
            info["link_addr"] = self.link.address
            info["link_tokens"] = self.link.offer(self.size)
        self.peers = rendezvous.serve_and_register(
            topology.rendezvous_addr, info, start_timeout_s,
            serve=topology.serve_rendezvous and self.rank == 0)
        silence_ms = min(int(self.peer_timeout_s * 1000), 2**31 - 1) if self.peer_timeout_s > 0 else 2**31 - 1
        for peer in self.peers:
            r = int(peer["rank"])
            if r == self.rank:
                continue  # (a message claiming to be from this rank is foreign)
            self._ident_to_rank[struct.pack("<I", r)] = r
            same_host = peer["host"] == topology.hostname
            addr = peer["endpoints"]["ipc" if same_host else "tcp"]
            if same_host and type(peer.get("pid")) is int:
                self._pids[r] = peer["pid"]
            d = self.ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.ROUTING_ID, struct.pack("<I", self.rank))
            d.setsockopt(zmq.SNDHWM, 0)
            d.setsockopt(zmq.LINGER, 2000)
            d.setsockopt(zmq.SNDBUF, 4 << 20)
            d.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)  # (see the module docstring)
            d.setsockopt(zmq.HEARTBEAT_TIMEOUT, silence_ms)
            if not same_host:
                d.setsockopt(zmq.TCP_MAXRT, LINK_TIMEOUT_MS)  # TCP_USER_TIMEOUT
            if self.encrypt:
                security.secure_client(d, self._secret)
            else:
                security.secure_client(d, self._secret, str(self.rank), self._token_from(peer))
            mon = d.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED
                                       | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            d.connect(addr)
            self.dealers[r] = d
            self.monitors[mon] = r
            self.poller.register(mon, zmq.POLLIN)
        if self.shm is not None:
            if all(p["host"] == topology.hostname and p.get("shm") for p in self.peers):
                for p in self.peers:
                    if int(p["rank"]) != self.rank:
                        self.shm.attach(int(p["rank"]), p["shm"])
                if self.shm.rings:
                    self.ctrl = shm_ctrl.ControlRings(self.shm, self.rank, self._open_bells(self.peers))
                    self.ctrl.start()  # (before the HELLOs: a peer reads it once ours arrived)
            else:  # some rank elsewhere: segments of this host's ranks only (hierarchical collectives)
                same = [p for p in self.peers if p["host"] == topology.hostname and int(p["rank"]) != self.rank]
                if same and all(p.get("shm") for p in same):
                    for p in same:
                        self.shm.attach(int(p["rank"]), p["shm"])
                    self.host_shm = self.shm
                    if self.shm.rings:  # control between this host's ranks: rings too
                        self.ctrl = shm_ctrl.ControlRings(self.shm, self.rank, self._open_bells(same))
                        self.ctrl.start()
                self.shm = None  # the world's collectives take ZeroMQ
        for r in self.dealers:  # HELLO from a peer also means it has mapped our segment
            self.send(r, HELLO)
        deadline = time.monotonic() + start_timeout_s
        for r in self.dealers:
            self.recv(r, HELLO, deadline=deadline)
        self._open_link(deadline)
        if self.ctrl is not None:
            self.ctrl.ready()

    def leaders(self) -> List[int]:
        """Each host's lowest rank, ascending (the hosts' order in :mod:`sdp.engine.hostlink`)."""
        first: Dict[str, int] = {}
        for p in self.peers:
            first.setdefault(p["host"], int(p["rank"]))
        return sorted(first.values())

    def _open_link(self, deadline: float) -> None:
        """After rendezvous: the leaders' link is on when the job spans hosts and every rank offered
        it with the shared memory its host's ranks need (ranks alone on a host need none); then
        this host's leader connects to every other leader (by ``deadline``)."""
        if self.link is None:
            return
        hosts = collections.Counter(p["host"] for p in self.peers)
        self.link_on = len(hosts) > 1 and all("link" in p and (p["link"] or hosts[p["host"]] == 1)
                                                     for p in self.peers)
        leaders = self.leaders()
        if not self.link_on or self.rank not in leaders:
            self.link.close()
            self.link = None
            return
        self.link.open(leaders, {int(p["rank"]): p for p in self.peers}, deadline)

    def link_send(self, dst: int, body) -> None:
        """Send ``body`` (bytes-like) to leader ``dst`` on the leaders' link (nothing once the
        mesh is closed: the caller's wait then meets the reason)."""
        link = self.link
        if link is not None:
            link.send(dst, body)

    def link_recv(self, timeout_ms: float) -> list:
        """``[(source rank, frames), ...]`` that arrived on the leaders' link, waiting up to
        ``timeout_ms`` for the first (``[]`` at once once the mesh is closed)."""
        link = self.link
        return link.recv(timeout_ms) if link is not None else []

    def _open_bells(self, peers: List[dict]) -> Dict[int, int]:
        """The doorbells of ``peers`` (same-host rendezvous entries) opened for writing, or {}
        (with a warning) if any cannot be: this rank then sends its control messages over ZeroMQ
        (it still reads the rings)."""
        bells = {}
        try:
            for p in peers:
                if int(p["rank"]) != self.rank:
                    path = p.get("bell")
                    if not isinstance(path, str) or not path.startswith("/proc/"):
                        raise OSError(f"rank {p['rank']} registered no doorbell")
                    bells[int(p["rank"])] = shm_ctrl.open_bell(path)
        except OSError as e:
            log.warning("rank %d: control messages over ZeroMQ: cannot open a peer's doorbell (%s)", self.rank, e)
            for fd in bells.values():
                os.close(fd)
            return {}
        return bells

    def _token_from(self, peer: dict) -> str:
        try:
            return str(peer["tokens"][str(self.rank)])
        except (KeyError, TypeError):
            raise ProtocolError(f"rank {self.rank}: rank {peer.get('rank')} registered without a token for "
                                f"this rank (SDP_ENCRYPT differs between ranks?)") from None

    # -- sending ---------------------------------------------------------------------------
    def send(self, dst: int, kind: int, seq: int = 0, aux: int = 0, payload=None):
        """Queue a message to ``dst``; returns a ``zmq.MessageTracker`` for large zero-copy
        payloads (wait on it before modifying the buffer), else ``None``.  Never blocks."""
        if dst in self.lost:
            raise PeerLostError(dst, self.lost[dst])
        header = HEADER.pack(MAGIC, kind, aux, seq)
        sock = self.dealers[dst]
        if payload is None:
            sock.send(header)
            return None
        nbytes = memoryview(payload).nbytes
        if nbytes < COPY_BELOW:
            sock.send_multipart([header, payload], copy=True)
            return None
        sock.send(header, zmq.SNDMORE)
        return sock.send(payload, copy=False, track=True)

    def send_ctrl(self, dst: int, body: bytes) -> None:
        """Send a control message: through the shared-memory ring to ``dst`` when it is on this
        host (:mod:`sdp.transport.shm_ctrl`), else (or when it does not fit) ZeroMQ."""
        seq = 0
        if self.ctrl is not None and dst in self.ctrl.bells:
            if dst in self.lost:
                raise PeerLostError(dst, self.lost[dst])
            seq = self.ctrl.send(dst, body)
            if seq is None:
                return
        self.send(dst, CTRL, seq=seq, payload=body)
        self.hand_off()

    def recv_ctrl(self, src: int) -> List[bytes]:
        """The control messages from ``src`` that have arrived, in the order sent (never blocks)."""
        box = self.inbox.get((src, CTRL))
        if self.ctrl is not None and self.ctrl.senders.get(src):
            return self.ctrl.recv(src, box)
        out = []
        while box:
            frames = box.popleft()[2]
            out.append(frames[0].bytes if frames else b"")  # (no payload: dropped as malformed)
        return out

    @staticmethod
    def hand_off() -> None:
        """Yield this thread's core so ZeroMQ's I/O thread moves what was just queued now.
        Without it, the scheduler often wakes the I/O thread on this very core, where it waits
        behind the numpy work this thread does next: a control message sent before packing a
        12.8 MB fusion bucket then reached its peer only after the packing (~1 ms late) in
        40-70% of gradient lists on a 2-core host.  Costs one system call."""
        os.sched_yield()

    # -- receiving -------------------------------------------------------------------------
    def _drain_monitors(self, ready) -> None:
        for mon, r in self.monitors.items():
            if mon not in ready:
                continue
            while mon.poll(0):
                ev = recv_monitor_message(mon)
                if ev["event"] == zmq.EVENT_DISCONNECTED and r not in self.lost:
                    self._suspects.setdefault(r, time.monotonic())
                elif r in self._suspects:  # the DEALER redials at once: what answers tells why
                    if ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                        self._redial[r] = "refused at authentication"
                    elif ev["event"] == zmq.EVENT_CONNECTED and self._redial.get(r) != "refused at authentication":
                        self._redial[r] = "accepted"
                    elif ev["event"] == zmq.EVENT_CONNECT_RETRIED:
                        self._redial.setdefault(r, "refused")

    def _confirm_losses(self) -> None:
        """A peer whose connection to us dropped is lost once it said BYE (everything it sent
        came before that, on one ordered connection) or after ``LOSS_GRACE_S``: its connection
        *to* us may still be delivering what it sent before it closed."""
        now = time.monotonic()
        for r, since in list(self._suspects.items()):
            if r in self.departed or now - since >= LOSS_GRACE_S or (
                    now - since >= DEAD_GRACE_S and r in self._pids
                    and process_state(self._pids[r]) in (None, "Z", "X", "x")):
                del self._suspects[r]
                reason = "it shut down" if r in self.departed else self._loss_reason(r)
                self.lost[r] = reason
                if r not in self.departed:
                    log.error("rank %d: lost rank %d: %s", self.rank, r, reason)

    def _loss_reason(self, r: int) -> str:
        """Why rank ``r``'s connection dropped, as far as this host can tell (module docstring)."""
        if r in self._pids:
            state = process_state(self._pids[r])
            if state is None or state in "ZXx":
                return f"its process (pid {self._pids[r]}) died"
            return (f"no message from rank {r} for {self.peer_timeout_s:g} s: stopped, hung or unreachable "
                    f"(pid {self._pids[r]} is alive, state {state}; SDP_PEER_TIMEOUT={self.peer_timeout_s:g})")
        redial = self._redial.pop(r, None)  # (another host: what its kernel said to a new connection)
        if redial == "refused" and self._refused_by(r):  # (not refused, but unreachable: a cut link)
            return "its process died (its host refused a new connection)"
        if redial == "refused at authentication":  # (its process runs: it answered, then refused the spent token)
            return ("our connection to it dropped while its process runs (reset or closed on the way: a middlebox, "
                    "a conntrack flush, ss -K), and the new connection was refused at authentication (a dropped mesh "
                    "connection is not admitted again: its single-use token is spent)")
        if redial == "accepted":
            return (f"no message from rank {r} for {self.peer_timeout_s:g} s: stopped, hung or unreachable "
                    f"(its host still accepts connections; SDP_PEER_TIMEOUT={self.peer_timeout_s:g})")
        return (f"its host stopped answering: no TCP acknowledgement for {LINK_TIMEOUT_MS / 1000:g} s "
                f"(link down or host gone) or no message for SDP_PEER_TIMEOUT={self.peer_timeout_s:g} s")

    def _refused_by(self, r: int, timeout_s: float = 0.3) -> bool:
        """Whether a TCP connection to rank ``r``'s endpoint is refused (ECONNREFUSED: its host
        answers, nothing listens) rather than unanswered or unreachable (EHOSTUNREACH: a failed
        ARP after a link went down), within ``timeout_s``.  Used only once a peer is lost."""
        try:
            host, port = self.peers[r]["endpoints"]["tcp"][len("tcp://"):].rsplit(":", 1)
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
                probe.settimeout(timeout_s)
                return probe.connect_ex((host.strip("[]"), int(port))) == errno.ECONNREFUSED
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return False

    def _drain_router(self) -> None:
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            src = self._ident_to_rank.get(frames[0].bytes)
            head = frames[1].bytes if len(frames) > 1 else b""
            if src is None or len(head) != HEADER.size or head[:4] != MAGIC:
                log.warning("rank %d: dropping foreign/malformed message (%d frames, header %r)",
                            self.rank, len(frames), head[:16])
                continue
            _, kind, aux, seq = HEADER.unpack(head)
            if kind == BYE:
                self.departed.add(src)
            elif kind == ABORT:
                try:
                    self.aborted[src] = json.loads(frames[2].bytes)
                except (ValueError, IndexError):
                    self.aborted[src] = {"lost": None, "err": "unreadable abort message"}
                continue
            self.inbox[(src, kind)].append((aux, seq, frames[2:]))

    def pump(self, timeout_ms: Optional[float]) -> None:
        """Wait up to ``timeout_ms`` (None: forever) for socket activity and sort it into inboxes."""
        if self._suspects:
            timeout_ms = 50 if timeout_ms is None else min(timeout_ms, 50)
        ready = dict(self.poller.poll(timeout_ms))
        if ready.keys() - self._quiet_fds:  # (an empty recv costs ~6 us: its zmq.Again)
            self._drain_router()  # first: a peer's BYE must be seen before its disconnect event
        if len(ready) > (self.router in ready):
            self._drain_monitors(ready)
        if self._suspects:
            self._confirm_losses()
        while self.link_lost:
            r, reason = self.link_lost.popleft()
            if r not in self.lost:
                self.lost[r] = reason

    def _link_failed(self, rank: int, reason: str) -> None:
        """(Any thread.) The leaders' link to ``rank`` failed past repair: it is lost at the
        engine thread's next :meth:`pump`."""
        self.link_lost.append((rank, reason))

    def recv(self, src: int, kind: int, seq: Optional[int] = None, aux: Optional[int] = None,
             deadline: Optional[float] = None):
        """Return the payload frames of the next ``kind`` message from ``src``.

        Raises :class:`ProtocolError` if its ``seq``/``aux`` are not the expected ones,
        :class:`PeerLostError` if ``src`` disconnects, :class:`CollectiveTimeoutError` after
        ``deadline`` (monotonic seconds; default now + ``timeout_s``)."""
        box = self.inbox[(src, kind)]
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        while not box:
            if src in self.lost:
                raise self.peer_error()
            if self.stopping:
                raise SdpError(f"rank {self.rank}: shut down while waiting for rank {src}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: no message from rank {src} within {self.timeout_s:g} s")
            self.pump(min(left, 1.0) * 1000)
        m_aux, m_seq, frames = box.popleft()
        if (seq is not None and m_seq != seq) or (aux is not None and m_aux != aux):
            raise ProtocolError(f"rank {self.rank}: expected message seq={seq} aux={aux} from rank "
                                f"{src}, got seq={m_seq} aux={m_aux}")
        return frames

    def take(self, src: int, kind: int, aux: int):
        """``(seq, payload frames)`` of the first ``kind`` message from ``src`` that has arrived
        with ``aux`` (messages with another ``aux`` stay, in order), or None (never blocks)."""
        box = self.inbox.get((src, kind))
        if box:
            for i, (m_aux, seq, frames) in enumerate(box):
                if m_aux == aux:
                    del box[i]
                    return seq, frames
        return None

    def peer_error(self) -> PeerLostError:
        """The error to raise now that some peer is lost: names the rank that failed first,
        following ABORT notes from peers that failed because of it."""
        self._drain_router()
        direct = [r for r in sorted(self.lost) if r not in self.aborted]
        if direct:
            return PeerLostError(direct[0], self.lost[direct[0]])
        src = min(self.aborted) if self.aborted else min(self.lost)
        note = self.aborted.get(src, {})
        if note.get("lost") is not None:  # (one flat message: the cause, and who saw it)
            lost, err = int(note["lost"]), str(note.get("err"))
            err = re.sub(r"^(lost connection to rank \d+: )+", "", err)
            err = re.sub(r"( \(reported by rank \d+\))+$", "", err)
            return PeerLostError(lost, f"{err} (reported by rank {src})")
        return PeerLostError(src, note.get("err") or self.lost.get(src, "lost"))

    def abort(self, lost: Optional[int], err: str) -> None:
        """Tell every live peer why this rank is failing, then close without waiting."""
        body = json.dumps({"lost": lost, "err": err}).encode()
        for r in self.dealers:
            if r not in self.lost:
                try:
                    self.send(r, ABORT, payload=body)
                except Exception:  # noqa: BLE001 - best effort on the way down
                    pass
        self.close(linger_s=0.5)

    def sendrecv_done(self, trackers) -> None:
        """Wait until ZeroMQ has released every tracked buffer.

        A buffer queued to a peer that died is never released, so the wait watches the peers
        between slices of ``TRACKER_SLICE_S``: :class:`PeerLostError` once a peer is lost (a dead
        one is seen in ~1 s), :class:`CollectiveTimeoutError` after ``timeout_s``.  (It once
        waited the whole ``timeout_s``, 300 s by default, in one call, deaf to the peer's death.)"""
        deadline = time.monotonic() + self.timeout_s
        for t in trackers:
            while t is not None and not t.done:
                try:
                    t.wait(TRACKER_SLICE_S)
                except zmq.NotDone:
                    self.pump(0)
                    if self.lost:
                        raise self.peer_error() from None
                    if self.stopping:
                        raise SdpError(f"rank {self.rank}: shut down while ZeroMQ still held a sent buffer") from None
                    if time.monotonic() > deadline:
                        raise CollectiveTimeoutError(
                            f"rank {self.rank}: a sent buffer was not released within {self.timeout_s:g} s") from None

    # -- teardown --------------------------------------------------------------------------
    def close(self, linger_s: float = 2.0) -> None:
        """Say BYE to every live peer and close.  Does not wait for the peers (a rank may leave
        while others still compute); ZeroMQ keeps delivering what is queued for up to
        ``linger_s`` seconds (a dead peer's share is dropped then).  A BYE queued to a peer that
        has closed would hold the close for the whole ``linger_s`` (the last rank of a job to shut
        down took 2.1 s in 4 runs of 6): so a peer that said BYE gets none back, and a peer that
        is leaving too gets up to ``BYE_WAIT_S`` for its BYE to arrive."""
        self._drain_router()  # first: the BYEs that arrived (read, so TCP closes with FIN, not RST)
        for r in self.dealers:
            if r not in self.lost and r not in self.departed:
                try:
                    self.send(r, BYE)
                except zmq.ZMQError:
                    pass
        deadline = time.monotonic() + min(linger_s, BYE_WAIT_S)
        while set(self.dealers) - set(self.lost) - self.departed:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if self.router.poll(left * 1000):
                self._drain_router()
        gone = set(self.lost) | self.departed
        if self.ctrl is not None:
            self.ctrl.close()
        for mon in self.monitors:
            mon.close(linger=0)
        for r, d in self.dealers.items():
            d.close(linger=0 if r in gone else int(linger_s * 1000))
        if self._guard is not None:
            self._guard.stop()
        if self.link is not None:  # (waits for a caller's thread using it)
            self.link.close()
        self.router.close(linger=0)
        if self._gate is not None:
            self._gate.stop()
        self.ctx.term()
        if self._ipc_dir is not None:
            try:
                os.unlink(os.path.join(self._ipc_dir, "r.sock"))
                os.rmdir(self._ipc_dir)
            except OSError:
                pass

"""Rendezvous: every rank registers ``(rank, host, endpoints)`` and receives the full table.

The server is a ZeroMQ ROUTER socket served from a background thread, either by ``sdprun`` (which
sets ``SDP_RENDEZVOUS_ADDR``) or, without a launcher, by rank 0 at ``MASTER_ADDR:MASTER_PORT``.
Clients use a REQ socket.  Messages are JSON objects (never pickle).  The server serves successive
rounds: once ``size`` ranks have registered it answers all of them and starts a new round.

Security: server and clients authenticate and encrypt with CURVE keys derived from the job secret
(:mod:`sdp.transport.security`), so a process without it can neither register nor read the table
(which carries the ranks' single-use mesh tokens).  The server never binds ``*``/``0.0.0.0``.
A request is at most ``MAX_REQUEST_BYTES``; a malformed one (not JSON, too deep, ``rank`` not a
whole number in range, ...) is answered with an error and logged, and the server keeps serving.
"""
import json
import logging
import threading
import time
from typing import Dict, List, Optional

import zmq

from sdp.common.errors import RendezvousError
from sdp.transport import security

MAX_REQUEST_BYTES = 1 << 20  # one rank's entry: endpoints, host name, shm path, one token per peer

log = logging.getLogger("sdp.rendezvous")


class RendezvousServer:
    """Serve rendezvous for ``size`` ranks at ``tcp://host:port`` (port 0 picks a free port).

    ``host`` is one local address or name (e.g. :func:`sdp.common.network.bind_address`); ``*``,
    ``0.0.0.0`` and ``::`` raise ``ValueError``.  ``secret`` is the job secret (default
    ``SDP_SECRET``/``SDP_SECRET_FILE``); without one, a server for more than one rank raises
    :class:`~sdp.transport.security.SecretError`.  ``timeout_s`` (seconds) bounds a round: if some
    ranks have registered and the rest have not after that long, the registered ones get an error
    naming the missing ranks.  Raises ``zmq.ZMQError`` when the address cannot be bound.
    """

    def __init__(self, size: int, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0,
                 secret: Optional[str] = None):
        if host in ("*", "0.0.0.0", "::", "[::]", ""):
            raise ValueError(f"rendezvous host {host!r} would listen on every interface; give one "
                             "address (e.g. sdp.common.network.bind_address())")
        self.size = size
        self.timeout_s = timeout_s
        secret = secret or security.require_secret(size) or security.new_secret()
        self._ctx = zmq.Context()
        self._gate = security.Gatekeeper(self._ctx, secret, "rendezvous")
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        security.secure_server(self._sock, secret)
        # the slot policy (sdp.transport.guard): strangers never displace a rank's connection
        self._guard = self._gate.guard(self._sock)
        try:
            if port:
                self._sock.bind(f"tcp://{host}:{port}")
            else:
                port = self._sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError:
            self._close()
            raise
        self.address = f"tcp://{host}:{port}"
        self._stop = threading.Event()
        self._first_at = 0.0
        self._thread = threading.Thread(target=self._serve, name="sdp-rendezvous", daemon=True)

    def start(self) -> "RendezvousServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._close(linger_ms=2000)

    def _close(self, linger_ms: int = 0) -> None:
        self._guard.stop()
        self._sock.close(linger=linger_ms)
        self._gate.stop()
        self._ctx.term()

    def _reply(self, ident: bytes, obj) -> None:
        self._sock.send_multipart([ident, b"", json.dumps(obj).encode()])

    def _serve(self) -> None:
        waiting: Dict[int, tuple] = {}  # rank -> (ident, info)
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if waiting and time.monotonic() - self._first_at > self.timeout_s:
                    missing = sorted(set(range(self.size)) - set(waiting))
                    err = f"ranks {missing} did not reach rendezvous within {self.timeout_s:g} s"
                    log.error(err)
                    for ident, _ in waiting.values():
                        self._reply(ident, {"error": err})
                    waiting.clear()
                if poller.poll(100):
                    self._handle(self._sock.recv_multipart(), waiting)
            except Exception:  # noqa: BLE001 - one bad request must not end the job's rendezvous
                log.exception("rendezvous: error while serving a request (still serving)")

    def _handle(self, frames: List[bytes], waiting: Dict[int, tuple]) -> None:
        if len(frames) != 3 or frames[1] != b"":
            log.warning("rendezvous: dropping malformed message (%d frames)", len(frames))
            return
        ident = frames[0]
        try:
            info = _parse_request(frames[2])
        except ValueError as e:
            log.warning("rendezvous: refusing a malformed request (%s): %r", e, frames[2][:64])
            self._reply(ident, {"error": f"malformed rendezvous request: {e}"})
            return
        rank, size = info["rank"], info["size"]
        if size != self.size or not 0 <= rank < size:
            log.warning("rendezvous: refusing rank %d of size %d (job size %d)", rank, size, self.size)
            self._reply(ident, {"error": f"rank {rank} registered with size {size}, "
                                         f"but this job has size {self.size}"})
            return
        if rank in waiting:
            log.warning("rendezvous: rank %d registered twice", rank)
            self._reply(ident, {"error": f"rank {rank} registered twice "
                                         f"(hosts {waiting[rank][1].get('host')} and {info.get('host')})"})
            return
        if not waiting:
            self._first_at = time.monotonic()
        waiting[rank] = (ident, info)
        if len(waiting) == self.size:
            table = [waiting[r][1] for r in range(self.size)]
            for ident, _ in waiting.values():
                self._reply(ident, {"peers": table})
            waiting.clear()


def _parse_request(body: bytes) -> dict:
    """The registration in ``body``, checked: a JSON object whose ``rank`` and ``size`` are whole
    numbers with ``size >= 1``.  Raises ``ValueError`` saying what is wrong."""
    try:
        info = json.loads(body)
    except (ValueError, RecursionError) as e:  # not JSON / nested too deep
        raise ValueError(f"not a JSON object ({type(e).__name__})") from None
    if not isinstance(info, dict):
        raise ValueError(f"a JSON {type(info).__name__}, not an object")
    for key in ("rank", "size"):
        v = info.get(key)
        if type(v) is not int:  # noqa: E721 - bools, floats (1e999) and strings are refused
            raise ValueError(f"{key!r} is {str(v)[:32]!r}, not a whole number")
    if info["size"] < 1:
        raise ValueError(f"size {info['size']} < 1")
    return info


def register(address: str, info: dict, timeout_s: float, secret: Optional[str] = None) -> List[dict]:
    """Register ``info`` (must hold ``rank`` and ``size``) at ``address``; return the table of all
    ranks' infos, indexed by rank.  ``secret``: the job secret (default from the environment).
    Raises :class:`RendezvousError` on error or after ``timeout_s`` seconds."""
    secret = secret or security.require_secret(info["size"]) or security.new_secret()
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    security.secure_client(sock, secret)
    try:
        sock.connect(address)
        sock.send(json.dumps(info).encode())
        if not sock.poll(int(timeout_s * 1000)):
            raise RendezvousError(
                f"rank {info['rank']}: no answer from rendezvous at {address} within {timeout_s:g} s "
                f"(are all {info['size']} ranks started, with the same job secret {security.SECRET_ENV}?)")
        try:
            reply = json.loads(sock.recv())
            if not isinstance(reply, dict) or not isinstance(reply.get("error", reply.get("peers")), (str, list)):
                raise ValueError(str(reply)[:200])
        except ValueError as e:
            raise RendezvousError(f"rank {info['rank']}: malformed answer from rendezvous at {address}: {e}") from None
    finally:
        sock.close()
    if "error" in reply:
        raise RendezvousError(f"rank {info['rank']}: rendezvous failed: {reply['error']}")
    return reply["peers"]


def serve_and_register(address: Optional[str], info: dict, timeout_s: float, serve: bool) -> List[dict]:
    """Register at ``address``; when ``serve`` is true (rank 0 without a launcher) first start a
    server there for the duration of the round."""
    server = None
    if serve:
        host, port = address[len("tcp://"):].rsplit(":", 1)
        try:
            server = RendezvousServer(info["size"], host=host, port=int(port), timeout_s=timeout_s).start()
        except (zmq.ZMQError, ValueError) as e:
            raise RendezvousError(f"rank 0 cannot serve rendezvous at {address}: {e}") from None
    try:
        return register(address, info, timeout_s + 5)
    finally:
        if server is not None:
            server.stop()

"""Rendezvous: every rank registers ``(rank, host, endpoints)`` and receives the full table.

The server is a ZeroMQ ROUTER socket served from a background thread, either by ``sdprun`` (which
sets ``SDP_RENDEZVOUS_ADDR``) or, without a launcher, by rank 0 at ``MASTER_ADDR:MASTER_PORT``.
Clients use a REQ socket.  Messages are JSON objects (never pickle: the port is reachable by
anything on the network).  The server serves successive rounds: once ``size`` ranks have
registered it answers all of them and starts a new round.
"""
import json
import logging
import threading
import time
from typing import Dict, List, Optional

import zmq

from sdp.common.errors import RendezvousError

log = logging.getLogger("sdp.rendezvous")


class RendezvousServer:
    """Serve rendezvous for ``size`` ranks at ``tcp://host:port`` (port 0 picks a free port).

    ``timeout_s`` (seconds) bounds a round: if some ranks have registered and the rest have not
    after that long, the registered ones get an error naming the missing ranks.
    """

    def __init__(self, size: int, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0):
        self.size = size
        self.timeout_s = timeout_s
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 1000)
        bind_host = "*" if host in ("0.0.0.0", "*") else host
        if port:
            self._sock.bind(f"tcp://{bind_host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{bind_host}")
        self.address = f"tcp://{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="sdp-rendezvous", daemon=True)

    def start(self) -> "RendezvousServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._sock.close(linger=2000)

    def _reply(self, ident: bytes, obj) -> None:
        self._sock.send_multipart([ident, b"", json.dumps(obj).encode()])

    def _serve(self) -> None:
        waiting: Dict[int, tuple] = {}  # rank -> (ident, info)
        first_at = None
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if waiting and time.monotonic() - first_at > self.timeout_s:
                missing = sorted(set(range(self.size)) - set(waiting))
                err = f"ranks {missing} did not reach rendezvous within {self.timeout_s:g} s"
                log.error(err)
                for ident, _ in waiting.values():
                    self._reply(ident, {"error": err})
                waiting.clear()
            if not poller.poll(100):
                continue
            frames = self._sock.recv_multipart()
            if len(frames) != 3 or frames[1] != b"":
                log.warning("rendezvous: dropping malformed message (%d frames)", len(frames))
                continue
            ident = frames[0]
            try:
                info = json.loads(frames[2])
                rank, size = int(info["rank"]), int(info["size"])
            except (ValueError, KeyError, TypeError):
                log.warning("rendezvous: dropping foreign message %r", frames[2][:64])
                self._reply(ident, {"error": "malformed rendezvous request"})
                continue
            if size != self.size or not 0 <= rank < size:
                self._reply(ident, {"error": f"rank {rank} registered with size {size}, "
                                             f"but this job has size {self.size}"})
                continue
            if rank in waiting:
                self._reply(ident, {"error": f"rank {rank} registered twice "
                                             f"(hosts {waiting[rank][1].get('host')} and {info.get('host')})"})
                continue
            if not waiting:
                first_at = time.monotonic()
            waiting[rank] = (ident, info)
            if len(waiting) == self.size:
                table = [waiting[r][1] for r in range(self.size)]
                for ident, _ in waiting.values():
                    self._reply(ident, {"peers": table})
                waiting.clear()


def register(address: str, info: dict, timeout_s: float) -> List[dict]:
    """Register ``info`` (must hold ``rank`` and ``size``) at ``address``; return the table of all
    ranks' infos, indexed by rank.  Raises :class:`RendezvousError` on error or after
    ``timeout_s`` seconds."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send(json.dumps(info).encode())
        if not sock.poll(int(timeout_s * 1000)):
            raise RendezvousError(
                f"rank {info['rank']}: no answer from rendezvous at {address} within {timeout_s:g} s "
                f"(are all {info['size']} ranks started?)")
        reply = json.loads(sock.recv())
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
        except zmq.ZMQError as e:
            raise RendezvousError(f"rank 0 cannot serve rendezvous at {address}: {e}") from None
    try:
        return register(address, info, timeout_s + 5)
    finally:
        if server is not None:
            server.stop()

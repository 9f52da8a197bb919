"""Peer-to-peer model store: ``save_variable`` / ``request_variable`` and ``PairAveragingOptimizer``.

Every worker keeps its latest saved arrays (by name, with a few recent versions) in a
``sdp.transport.store.Server`` and pulls peers' arrays with a
``sdp.transport.store.Client``, at any time and without the owner taking part (AD-PSGD's
premise).  Peer addresses are exchanged with ``sdp.api.allgather_object`` at the start of each
cluster epoch (``on_epoch``).  Raises ``StoreError`` / ``StoreTimeoutError``
(``SDP_STORE_TIMEOUT`` seconds, default 60).
"""
import atexit
import threading
from typing import List, Optional

import numpy as np

from sdp import api
from sdp.transport.store import Client, Server, StoreError, StoreTimeoutError  # noqa: F401 - re-exported


_server: Optional[Server] = None
_client: Optional[Client] = None
_peers: List[str] = []
_epoch: Optional[int] = None
_mutex = threading.Lock()


def _host() -> str:
    """The address peers reach this process at: the engine's own TCP address (same interface)."""
    try:
        tcp = api.runtime().mesh.endpoints["tcp"]
        return tcp[len("tcp://"):].rsplit(":", 1)[0]
    except Exception:  # noqa: BLE001 - a runtime without a mesh address: loopback
        return "127.0.0.1"


def server() -> Server:
    global _server, _client
    with _mutex:
        if _server is None:
            _server = Server(_host())
            _client = Client()
            atexit.register(_close)
        return _server


def _close() -> None:
    global _server, _client
    with _mutex:
        if _server is not None:
            _server.close()
        if _client is not None:
            _client.close()
        _server = _client = None


def on_epoch(epoch: int, name: str) -> None:
    """Exchange store addresses with every member of the new epoch (a collective)."""
    global _peers, _epoch
    addr = server().address
    peers = api.allgather_object(addr, name=name)
    with _mutex:
        _peers, _epoch = list(peers), epoch


def epoch() -> Optional[int]:
    return _epoch


def peers() -> List[str]:
    return list(_peers)


def save(name: str, array, version: Optional[int] = None) -> None:
    """Save ``array`` under ``name`` (and ``version``) in this worker's store."""
    server().save(name, array, version)


def request(rank: int, name: str, version: Optional[int] = None,
            timeout: Optional[float] = None) -> np.ndarray:
    """Pull ``name`` (latest, or ``version``) from the store of worker ``rank``.  Raises
    ``StoreError`` for an unknown rank/name/version, ``StoreTimeoutError`` on timeout."""
    table = _peers
    if not 0 <= int(rank) < len(table):
        raise StoreError(f"no worker of rank {rank} in the current cluster of {len(table)}")
    server()
    if int(rank) == api.rank():
        return _server.get(name, version)[0].copy()
    return _client.request(table[int(rank)], name, version, timeout, peer=f"rank {rank}")[0]

"""Point-to-point ``send`` and ``recv`` between two ranks (``sdp.api.send``/``recv``, and the
``torch.distributed`` backend's ``send``/``recv``): no coordinator, no negotiation, no fast lane.

A caller (any thread) queues an operation here and wakes the engine thread, which alone touches
the mesh (:meth:`PointToPoint.run`, once per engine cycle):

- a send is ``P2P`` messages to its peer over the mesh's authenticated connection, one per
  ``PIECE`` (4 MB) of the array, at least one (the tag in the header's ``aux``, the array's byte
  count in its ``seq``: no frame is larger than the mesh admits); pieces of 64 KB and more go
  without a copy, and the send completes once ZeroMQ has released every piece of the caller's
  buffer, so the caller may then reuse it;
- a receive copies the pieces of a message of its peer and tag into the caller's array as they
  arrive and completes with the last.  Messages of one peer and tag match receives in the order
  each side made them (as in MPI and Gloo); messages with other tags wait in the mesh's inbox
  meanwhile.  A message whose byte count is not the array's fails that receive with
  ``TensorMismatchError`` naming both ranks, the tag and both sizes, once its pieces are dropped.

An operation whose peer is lost (what arrived from it before is still received) fails with
``PeerLostError`` naming that peer; the engine and the other operations go on (a collective that
needs the lost rank fails as ever).  A send whose peer ended cleanly (it said BYE) completes:
ZeroMQ may hold the buffer, but nobody will read it.
"""
import collections
import threading
from typing import Callable, List

import numpy as np

from sdp.common import errors
from sdp.engine.handles import Handle
from sdp.transport.zmq_mesh import P2P

#: the largest tag (the mesh header's 32-bit ``aux``)
MAX_TAG = 2 ** 32 - 1
PIECE = 4 << 20  # bytes per message of a send (the mesh admits frames of at least 16 MB)


def pieces(nbytes: int) -> int:
    """How many messages a send of ``nbytes`` is (at least one)."""
    return max(1, -(-nbytes // PIECE))


class _Op:
    """One queued or pending send or receive (``got``: bytes received, ``left``: pieces of a
    refused message still to drop, ``error``: why it failed)."""

    __slots__ = ("send", "array", "peer", "tag", "handle", "trackers", "got", "left", "error")

    def __init__(self, send: bool, array: np.ndarray, peer: int, tag: int):
        self.send, self.array, self.peer, self.tag = send, array, peer, tag
        self.handle = Handle(f"{'send to' if send else 'recv from'} rank {peer} (tag {tag})")
        self.trackers, self.got, self.left, self.error = [], 0, None, None


class PointToPoint:
    """The engine thread's sends and receives; :meth:`submit` from any thread."""

    def __init__(self, rank: int, wake: Callable[[], None]):
        self.rank = rank
        self._wake = wake  # (Runtime._wake: the engine thread runs run() at once)
        self._lock = threading.Lock()
        self._queued: collections.deque = collections.deque()
        self._sending: List[_Op] = []  # sends whose buffer ZeroMQ still holds
        self._receiving: List[_Op] = []  # receives waiting for their message, in the order made

    def submit(self, send: bool, array: np.ndarray, peer: int, tag: int) -> Handle:
        """Queue a send of ``array`` to ``peer`` (``send``) or a receive into it from ``peer``;
        the arguments are checked by the caller (``sdp.api``).  Returns the handle: its
        ``wait()`` returns None for a send, the array for a receive."""
        op = _Op(send, array, peer, tag)
        with self._lock:
            self._queued.append(op)
        self._wake()
        return op.handle

    def busy(self) -> bool:
        """Whether an operation is queued or pending."""
        return bool(self._queued or self._sending or self._receiving)

    def poll_ms(self):
        """How long the engine thread may wait for its sockets now (ms), or None for as long as
        it likes: a held buffer's release wakes no poller, so it is looked at every 1 ms."""
        return 1.0 if self._sending else None

    def fail_lost(self, lost: dict) -> None:
        """(Engine thread, after :meth:`run`.)  Fail each pending operation whose peer is in
        ``lost`` (rank -> why) with ``PeerLostError`` naming it; the others go on."""
        for ops in (self._sending, self._receiving):
            for op in [op for op in ops if op.peer in lost]:
                op.handle._set(error=errors.PeerLostError(op.peer, lost[op.peer]))
                ops.remove(op)

    def run(self, mesh) -> None:
        """(Engine thread.)  Send what was queued, complete the sends ZeroMQ is done with and the
        receives whose message has arrived."""
        with self._lock:
            ops, self._queued = self._queued, collections.deque()
        for op in ops:
            if not op.send:
                self._receiving.append(op)
                continue
            flat, nbytes = op.array.reshape(-1).view(np.uint8), op.array.nbytes
            try:
                for at in range(0, pieces(nbytes) * PIECE, PIECE):
                    op.trackers.append(mesh.send(op.peer, P2P, nbytes, op.tag, flat[at:at + PIECE]))
            except errors.PeerLostError as e:
                op.handle._set(error=e)
                continue
            self._sending.append(op)
        if ops:
            mesh.hand_off()
        if self._sending:
            held = []
            for op in self._sending:  # (a peer that said BYE ended cleanly: what it read, it read)
                if op.peer in mesh.departed or all(t is None or t.done for t in op.trackers):
                    op.handle._set()
                else:
                    held.append(op)
            self._sending = held
        if self._receiving:
            waiting = []
            for op in self._receiving:
                while not op.handle._is_done:
                    got = mesh.take(op.peer, P2P, op.tag)
                    if got is None:
                        waiting.append(op)
                        break
                    self._piece(op, *got)
            self._receiving = waiting

    def _piece(self, op: _Op, total: int, frames) -> None:
        """One piece of a message (``total``: its byte count) for receive ``op``."""
        if op.left is None:  # (the message's first piece)
            want = op.array.nbytes
            op.left = pieces(total)
            if total != want:
                op.error = errors.TensorMismatchError(
                    f"recv on rank {self.rank} from rank {op.peer} (tag {op.tag}): rank {op.peer} sent {total} "
                    f"bytes, rank {self.rank}'s array holds {want} ({op.array.dtype}{list(op.array.shape)})")
        op.left -= 1
        if op.error is None:
            size = sum(len(f.buffer) for f in frames)
            if len(frames) != 1 or size != min(PIECE, op.array.nbytes - op.got):
                op.error = errors.ProtocolError(f"recv on rank {self.rank} from rank {op.peer} (tag {op.tag}): "
                                                f"a piece of {size} bytes at {op.got} of {op.array.nbytes}")
            else:
                flat = op.array.reshape(-1).view(np.uint8)
                np.copyto(flat[op.got:op.got + size], np.frombuffer(frames[0].buffer, np.uint8))
                op.got += size
        if op.left == 0:
            if op.error is not None:
                op.handle._set(error=op.error)
            else:
                op.handle._set(result=op.array)

    def fail_all(self, err: BaseException) -> None:
        """Fail every queued or pending operation with ``err``."""
        with self._lock:
            ops, self._queued = list(self._queued), collections.deque()
        for op in ops + self._sending + self._receiving:
            op.handle._set(error=err)
        self._sending, self._receiving = [], []

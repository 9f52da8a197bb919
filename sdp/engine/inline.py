"""Small allreduces across hosts whose bytes ride the negotiation (issue 30).

Across hosts a small allreduce costs three trips after its submission: the request to rank 0,
the response back, then the collective itself (recursive doubling, or the hierarchical
shared-memory phases with a cross exchange), each through ZeroMQ's I/O threads.  Here the
bytes travel *inline*: each rank appends the input of an eligible allreduce to the request it
sends to rank 0 anyway; once every rank's request (and bytes) for a name is there, rank 0
reduces the copies in rank order and appends the result to the response it sends anyway.  Two
trips instead of three, and every rank gets rank 0's bits (bit-identical results).

*Eligible* (:func:`eligible`, decided per rank): an allreduce of a host array, global (no
process set), no prescale, an op in :data:`UFUNCS`, at most :data:`MAX_SPREAD` bytes x
(size - 1) (rank 0 receives and sends that much per tensor), and alone in the request message
(several requests at once are fused better by the collective: 100 x 4 KB submitted one by one
took 10.1 ms inline against 7.7 ms fused on 2 x 2 emulated hosts).  A response carries at most
:data:`MESSAGE_BYTES` of results.  Rank 0 alone decides, per response item, whether it
runs inline: only when every rank sent its bytes with the name (and the length matches its own
request), no rank has joined, and its own timeline is off; otherwise the item runs the
collective as before, on every rank (the inputs are still there).  So a rank that sent no
bytes, or bytes rank 0 dropped, costs nothing but the bytes.

Framing: a control body with inline bytes is ``b"I"``, the JSON's length (u32), the JSON, then
the bytes, concatenated in the order the JSON lists them (``"in"``: names and ``"il"``: lengths
in a request; ``"st"``: ``[item index, length]`` pairs in a response).  Rank 0 keeps at most
:data:`STASH_BYTES` of one rank's bytes waiting for the other ranks (more is dropped: those
names run the collective); lengths are checked against the message before anything is kept.

On when the job spans hosts (on one host :mod:`sdp.engine.lane` does better, through shared
memory) and ``SDP_FAST_LANE`` is on.
"""
import json
import logging
import struct
from typing import Dict, List, Optional, Tuple

import numpy as np

from sdp.common.reduce_ops import UFUNCS

log = logging.getLogger("sdp.engine")

#: bytes x (size - 1): what rank 0 receives (and sends) per tensor.  2 x 2 emulated hosts on 2
#: cores, 4 alternating rounds: 1 KB 1109 vs 1415 us, 16 KB 1130 vs 1438, 64 KB 1603 vs 1435
#: (3 x 64 KB through rank 0 cost more than the hierarchical collective saved)
MAX_SPREAD = 64 << 10
MESSAGE_BYTES = 1 << 20  # inline result bytes per response
STASH_BYTES = 4 << 20  # bytes of one rank rank 0 keeps waiting for the others
_LEN = struct.Struct("<I")
MARK = b"I"


def eligible(req, size: int) -> bool:
    """Whether ``req`` (a :class:`sdp.engine.runtime.Request`) may travel inline in a job of
    ``size`` ranks."""
    a = req.array
    return (req.kind == "allreduce" and req.device is None and not req.ps and req.prescale == 1.0
            and req.op in UFUNCS and a.nbytes * (size - 1) <= MAX_SPREAD)


def encode(msg: dict, arrays: List[np.ndarray]) -> bytes:
    """A control body: ``msg`` as JSON, followed by ``arrays``' bytes when there are any."""
    head = json.dumps(msg).encode()
    if not arrays:
        return head
    return b"".join([MARK, _LEN.pack(len(head)), head] + [a.reshape(-1).view(np.uint8) for a in arrays])


def decode(body: bytes) -> Tuple[dict, memoryview]:
    """``(msg, inline bytes)`` of a control body; raises ``ValueError`` (malformed)."""
    if body[:1] != MARK:
        return json.loads(body), memoryview(b"")
    if len(body) < 1 + _LEN.size:
        raise ValueError("short inline header")
    (n,) = _LEN.unpack_from(body, 1)
    start = 1 + _LEN.size
    if n > len(body) - start:
        raise ValueError(f"inline header of {n} bytes in a body of {len(body)}")
    return json.loads(body[start:start + n]), memoryview(body)[start + n:]


def pieces(pairs, tail: memoryview) -> Optional[List[memoryview]]:
    """Cut ``tail`` by the lengths of ``pairs`` (``[key, length]`` each); None unless they are
    ints >= 0 that add up to exactly ``len(tail)``."""
    if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 and type(p[1]) is int
                                              and p[1] >= 0 for p in pairs):
        return None
    if sum(p[1] for p in pairs) != len(tail):
        return None
    out, at = [], 0
    for _, n in pairs:
        out.append(tail[at:at + n])
        at += n
    return out


class Stash:
    """Rank 0's inline bytes per name and rank (ranks 1 .. size - 1: rank 0 reads its own
    request), until the name's response."""

    def __init__(self, size: int):
        self.size = size
        self.by_name: Dict[str, Dict[int, memoryview]] = {}
        self.held = [0] * size  # bytes kept per rank

    def add(self, src: int, msg: dict, tail: memoryview) -> None:
        """Keep what ``src`` sent inline with request ``msg`` (``"in"``/``"il"``): dropped, with a
        warning, when malformed; beyond :data:`STASH_BYTES` of ``src``, dropped silently (those
        names then run the collective)."""
        names, lengths = msg.get("in"), msg.get("il")
        if names is None and not len(tail):
            return
        cut = (pieces([[n, k] for n, k in zip(names, lengths)], tail)
               if isinstance(names, list) and isinstance(lengths, list) and len(names) == len(lengths)
               and all(isinstance(n, str) for n in names) else None)
        if cut is None:
            log.warning("rank 0: dropping malformed inline bytes from rank %d", src)
            return
        for name, view in zip(names, cut):
            if self.held[src] + len(view) > STASH_BYTES:
                return
            old = self.by_name.setdefault(name, {}).get(src)
            if old is not None:
                self.held[src] -= len(old)
            self.by_name[name][src] = view
            self.held[src] += len(view)

    def take(self, name: str) -> Optional[Dict[int, memoryview]]:
        """Every rank's bytes for ``name`` (and forget them), or None if some rank's are missing."""
        got = self.by_name.pop(name, None)
        if got is None:
            return None
        for src, view in got.items():
            self.held[src] -= len(view)
        return got if len(got) == self.size - 1 and 0 not in got else None

"""Process sets in the engine: collectives among a subset of the job's ranks (Horovod's
``process_set=`` argument), next to those of the whole job (the global set, id 0).

**Registry.**  Every rank holds the same table ``id -> ranks`` (``Runtime.process_sets``),
filled by ``sdp.api.add_process_sets`` on every rank alike (ids ``1, 2, ...`` in the order the
sets were added; the job's coordinator, rank 0, holds the same table).

**Negotiation.**  Rank 0's coordinator negotiates every set, keyed by (set, name): a request for
set ``ps`` carries ``"ps": ps`` in its meta, and ``sdp.api`` names it ``<name>@ps<id>``, so a
name may be in flight on several sets at once.  A set's collective is ready once each of *its*
ranks submitted it (the coordinator checks that only they do), and its response item carries
``"ps"``; every rank receives every response and ranks outside the set skip the set's items.
One coordinator for all sets gives one order of all collectives, which every rank follows for the
collectives it takes part in; that is why overlapping sets cannot deadlock (the earliest
unfinished collective in that order always has every member ready), and why messages between two
ranks that share several sets arrive in the order they are read.  The cost: a set without rank 0
is negotiated only between rank 0's own collectives (its *data* moves concurrently with them;
collectives of disjoint sets overlap in time).

**Data path.**  A set's collectives run the flat ZeroMQ algorithms (ring, recursive doubling,
binomial-tree broadcast, pairwise alltoall) on a ``Group`` of its ranks,
tagged ``SET_TAG_BASE + id`` (apart from the hierarchy's groups and from every other set), with a
sequence counter of its own.  No shared memory and no hierarchical allreduce: those are for the
global set.  Allreduces of one set are fused as the global set's are (buckets never mix sets).
"""
from typing import Dict, List, Optional

import numpy as np

from sdp.common.reduce_ops import UFUNCS, ReduceOp, scale_in_place
from sdp.engine import collectives, fusion
from sdp.engine.groups import Group

SET_TAG_BASE = 1 << 15  # group tags of process sets: 2**15 + id (the hierarchy uses small tags)
MAX_SET_ID = (1 << 15) - 1
"""The largest process set id (sets get ids 1, 2, ... in the order they are added)."""


class SetComm:
    """This rank's view of one process set it belongs to: the group and its sequence counter."""

    def __init__(self, mesh, ps: int, ranks: List[int]):
        self.ps, self.ranks = ps, list(ranks)
        self.group = Group(mesh, self.ranks, SET_TAG_BASE + ps)
        self.seq = 0

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq


def _float_scale(req, dtype, n: int) -> Optional[float]:
    if dtype.kind in "iub":
        return None
    factor = req.postscale / (n if req.op == ReduceOp.AVERAGE else 1)
    return None if factor == 1.0 else factor


def _int_scale(buf, req, n: int) -> None:
    if buf.dtype.kind not in "iub":
        return
    if req.op == ReduceOp.AVERAGE:
        np.floor_divide(buf, n, out=buf)
    if req.postscale != 1.0:
        np.multiply(buf, req.postscale, out=buf, casting="unsafe")


def allreduce_bucket(comm: SetComm, reqs, segment_bytes: int, acc_dtype) -> List[np.ndarray]:
    """Allreduce the requests ``reqs`` of one fusion bucket (same dtype, op and scales) among the
    set's ranks; returns one result per request (a view of the bucket's buffer, or its ``out``)."""
    first, g = reqs[0], comm.group
    dtype = first.array.dtype
    arrays = [r.array for r in reqs]
    offs = fusion.offsets(arrays)
    buf = fusion.aligned_empty(dtype, offs[-1])
    fusion.zero_padding(buf, arrays, offs)
    fusion.pack(buf, arrays, offs)
    scale_in_place(buf, first.prescale)
    collectives.allreduce(g, buf, buf, UFUNCS[first.op], comm.next_seq(), segment_bytes, acc_dtype(dtype),
                          _float_scale(first, dtype, g.size))
    _int_scale(buf, first, g.size)
    out = []
    for i, r in enumerate(reqs):
        view = buf[offs[i]:offs[i] + r.array.size].reshape(r.array.shape)
        if r.out is not None:
            np.copyto(r.out, view)
            view = r.out
        out.append(view)
    return out


def single_result(comm: SetComm, req, item: Dict, segment_bytes: int, acc_dtype):
    """The result of a broadcast, allgather, alltoall or reducescatter among the set's ranks
    (``item``: the coordinator's response item; ``dim0``/``splits`` in the set's rank order;
    a broadcast's root is a job rank, which the coordinator checked is in the set)."""
    g, seq, seg, a = comm.group, comm.next_seq(), segment_bytes, req.array
    me, n = g.rank, g.size
    row = int(np.prod(a.shape[1:], dtype=np.int64)) if a.ndim else 1
    if req.kind == "broadcast":
        out = fusion.aligned_empty(a.dtype, a.size)
        np.copyto(out, a.reshape(-1))
        collectives.broadcast(g, out, comm.ranks.index(req.root), seq, seg)
        return out.reshape(a.shape)
    if req.kind == "allgather":
        dim0 = item["dim0"]
        edges = [int(e) for e in np.concatenate([[0], np.cumsum(dim0)]) * row]
        flat = fusion.aligned_empty(a.dtype, sum(dim0) * row)
        flat[edges[me]:edges[me + 1]] = a.reshape(-1)
        collectives.allgatherv(g, flat, edges, seq, seg)
        return flat.reshape((sum(dim0),) + a.shape[1:])
    if req.kind == "alltoall":
        splits = item["splits"]  # splits[i][j]: rows set rank i sends to set rank j
        send_edges = [int(e) * row for e in np.concatenate([[0], np.cumsum(splits[me])])]
        recv_rows = [splits[j][me] for j in range(n)]
        recv_edges = [int(e) * row for e in np.concatenate([[0], np.cumsum(recv_rows)])]
        out = np.empty((sum(recv_rows),) + a.shape[1:], dtype=a.dtype)
        collectives.alltoallv(g, a.reshape(-1), send_edges, out.reshape(-1), recv_edges, seq, seg)
        return out, np.asarray(recv_rows, dtype=np.int32)
    if req.kind == "reducescatter":
        rows = collectives._bounds(a.shape[0], n)
        edges = [e * row for e in rows]
        buf = a.copy().reshape(-1)
        scale_in_place(buf, req.prescale)
        collectives.reducescatter(g, buf, UFUNCS[req.op], seq, seg, edges, acc_dtype(buf.dtype),
                                  _float_scale(req, buf.dtype, n))
        mine = buf[edges[me]:edges[me + 1]]
        _int_scale(mine, req, n)
        return mine.reshape((rows[me + 1] - rows[me],) + a.shape[1:]).copy()
    raise ValueError(f"unknown kind {req.kind}")  # pragma: no cover - Request validates kinds

"""The fast lane's reductions (a part of :mod:`sdp.engine.lane`): what a rank computes once a
position is decided FAST — every rank's posted copy reduced in rank order (the same operations on
every rank, so the results are bit-identical), a broadcast's copy of the root's, a batch's parts
— with the engine's scaling (AVERAGE, postscale), and the records checked before any copy is
read (a malformed one raises :class:`ProtocolError`).  Kept apart from the decisions
(:mod:`sdp.engine.lane_decide`): which position to reduce is decided there, how to reduce it here.
:class:`LaneReductions` is a mixin of :class:`sdp.engine.lane.Lane`.
"""
import numpy as np

from sdp.common import errors
from sdp.common.reduce_ops import UFUNCS, accumulation_dtype
from sdp.engine import collectives, fusion
from sdp.engine.lane_batch import _Batch
from sdp.engine.lane_ring import _REC, _SIGS_MAX, DATA_BYTES, DEPTH, FAST


class LaneReductions:
    """The reductions of positions decided FAST (a mixin of :class:`sdp.engine.lane.Lane`)."""

    def _consume_batch(self, p: int, b, verdict: int) -> None:
        """Position ``p``, batch ``b``, was decided: FAST, every request gets its part of one
        reduction of the packed copies; else every request goes to the engine, in order."""
        self.counts["batches"] += 1
        self.counts["fast" if verdict == FAST else "slow"] += len(b.arrays)
        if verdict != FAST:
            self._handoff += b.to_engine(self._request)
            return
        try:
            parts = self._reduce(p, b)
        except Exception as e:  # noqa: BLE001 - these requests fail, not the lane
            b.fail(e)
            return
        b.done(parts)

    def _broadcast(self, p: int, req):
        """Position ``p``, a broadcast, was decided FAST: a copy of the root's."""
        a = req.array
        i = (p % DEPTH) * _REC
        off, got = self.rec[req.root][i + 1], self.rec[req.root][i + 2]
        if got != a.nbytes or not 0 <= off <= DATA_BYTES - got:
            raise errors.ProtocolError(f"rank {self.rank}: rank {req.root}'s fast-lane record for '{req.name}' "
                                       f"is malformed (offset {off}, {got} bytes, expected {a.nbytes})")
        out = fusion.aligned_empty(a.dtype, a.size)  # (aligned: the TF face wraps it without a copy)
        np.copyto(out, self.data[req.root][off:off + got].view(a.dtype))
        return out.reshape(a.shape)

    def _reduce(self, p: int, req):
        """Position ``p``, an allreduce, was decided FAST: reduce every rank's copy, in rank
        order, into a new array (``req.out`` if given); returns the request's result."""
        if type(req) is _Batch:  # (the packed copies; the parts of the result)
            dtype, size, out = req.dtype, req.layout.count, None
        else:
            dtype, size, out = req.array.dtype, req.array.size, req.out
        views = self._copies(p, req.name, dtype, size)
        result = self._result_array(dtype, size) if out is None else out.reshape(-1)
        collectives.reduce_copies(UFUNCS[req.op], views, result, accumulation_dtype(dtype),
                                  self._float_scale(req, dtype))
        self._int_scale(result, req)
        if req.layout is not None:
            return req.layout.views(result)
        return result.reshape(req.array.shape) if out is None else out

    def _copies(self, p: int, name: str, dtype: np.dtype, size: int) -> list:
        """Every rank's copy of position ``p`` (``size`` elements of ``dtype``), in rank order;
        raises :class:`ProtocolError` for a record of another size or outside the data ring."""
        isz, i = dtype.itemsize, (p % DEPTH) * _REC
        nbytes, typed = size * isz, self._typed.get(dtype) or self._typed_views(dtype)
        views = []
        for q in range(self.size):
            off, got = self.rec[q][i + 1], self.rec[q][i + 2]
            if got != nbytes or off % isz or not 0 <= off <= DATA_BYTES - nbytes:
                raise errors.ProtocolError(f"rank {self.rank}: rank {q}'s fast-lane record for '{name}' "
                                           f"is malformed (offset {off}, {got} bytes, expected {nbytes})")
            views.append(typed[q][off // isz:off // isz + size])
        return views

    def _typed_views(self, dtype: np.dtype) -> list:
        """Every rank's data ring as an array of ``dtype`` (slicing it is ~3x cheaper than a
        byte slice and a view), in rank order."""
        if len(self._typed) >= _SIGS_MAX:
            self._typed.clear()
        typed = self._typed[dtype] = [self.data[q].view(dtype) for q in range(self.size)]
        return typed


class _Scaling:
    """What integer scaling reads of a request (``Runtime._int_scale``)."""

    __slots__ = ("op", "postscale")

    def __init__(self, op, postscale: float):
        self.op, self.postscale = op, postscale

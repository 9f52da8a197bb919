"""Framework-free API on numpy arrays: the layer every face (TensorFlow, KungFu) is built on.

``init()`` reads the topology from the environment (see :mod:`sdp.common.topology`), meets the
other ranks and starts the engine.  Collectives come in ``*_async`` forms returning a
:class:`~sdp.engine.runtime.Handle` and synchronous forms returning numpy arrays.

Names identify a collective across ranks: ranks may submit in different orders, and the engine
matches them by name.  Without a ``name``, one is generated from a per-process counter, which
matches across ranks when every rank makes the same unnamed calls in the same order.

Dtypes: reductions (allreduce, reducescatter) take bool (SUM/MAX: logical or, MIN/PRODUCT:
logical and; no AVERAGE, no scale factors), int8/16/32/64, uint8-64, float16, bfloat16, float32
and float64 (16-bit floats are summed and scaled in float32 and rounded once); allgather,
broadcast and alltoall move any dtype without Python objects.  Anything else raises
``ValueError`` on the calling rank when submitted, before any other rank is involved; a
disagreement between ranks raises :class:`~sdp.common.errors.TensorMismatchError` on every rank.
"""
import atexit
import io
import itertools
import logging
import pickle
import threading
from typing import List, Optional, Sequence

import numpy as np

from sdp.common import topology as _topology
from sdp.common.config import Config
from sdp.common.errors import AlreadyInitializedError, NotInitializedError
from sdp.common.reduce_ops import ReduceOp, resolve_op
from sdp.engine.runtime import Handle, Request, Runtime

_lock = threading.Lock()
_runtime: Optional[Runtime] = None
_counters = {}
_counter_lock = threading.Lock()


def _setup_logging() -> None:
    import os
    level = os.environ.get("SDP_LOG_LEVEL")
    logger = logging.getLogger("sdp")
    if level:
        logger.setLevel(level.upper())
    if not logger.handlers and not logging.getLogger().handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        logger.addHandler(h)


def init(config: Optional[Config] = None) -> None:
    """Start sdp in this process: read the topology, rendezvous with all ranks, start the engine.

    Mirrors ``smdistributed.dataparallel.tensorflow.init`` / ``horovod.tensorflow.init``.
    Raises :class:`AlreadyInitializedError` if called twice (as SMDDP documents; the Horovod face
    under Horovod's names, :func:`sdp.tensorflow.mpi_ops.init`, turns that into a no-op),
    :class:`TopologyError` for a bad environment, :class:`RendezvousError` if the other ranks do
    not show up within ``SDP_START_TIMEOUT`` seconds."""
    global _runtime
    with _lock:
        if _runtime is not None:
            raise AlreadyInitializedError()
        _setup_logging()
        cfg = config or Config.from_env()
        _runtime = Runtime(_topology.from_env(), cfg)
        if cfg.timeline:
            from sdp.engine import timeline
            timeline.start(_runtime, cfg.timeline)
        _counters.clear()


def shutdown() -> None:
    """Stop the engine and close connections.  Safe to call when not initialized.

    Mirrors ``horovod.tensorflow.shutdown``; after it, ``init()`` may be called again."""
    global _runtime
    with _lock:
        rt, _runtime = _runtime, None
    if rt is not None:
        rt.shutdown()
        from sdp.engine import timeline
        timeline.stop(rt)


atexit.register(shutdown)


def set_fusion_threshold(nbytes: int) -> None:
    """Set the fusion buffer size in bytes (0 disables fusion); rank 0's setting decides the
    buckets for every rank.  SMDDP's ``bucket_cap_mb`` maps here through
    :func:`sdp.common.config.bucket_cap_mb_to_bytes`.  Raises ``ValueError`` if negative."""
    runtime("set_fusion_threshold()").set_fusion_threshold(nbytes)


def fusion_threshold() -> int:
    """The fusion buffer size in bytes this rank last set (``SDP_FUSION_THRESHOLD`` by default;
    rank 0's value decides the buckets)."""
    return runtime("fusion_threshold()").fusion_threshold


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome-trace timeline of every tensor's phases to ``file_path`` (rank 0).

    Mirrors ``horovod.tensorflow.start_timeline``; ``mark_cycles`` is accepted and ignored."""
    from sdp.engine import timeline
    timeline.start(runtime("start_timeline()"), file_path)


def stop_timeline() -> None:
    """Finish and close the timeline file.  Mirrors ``horovod.tensorflow.stop_timeline``."""
    from sdp.engine import timeline
    timeline.stop(runtime("stop_timeline()"))


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``.  Mirrors ``horovod.tensorflow.is_initialized``."""
    return _runtime is not None


def runtime(what: str = "this function") -> Runtime:
    """The engine of this process; raises :class:`NotInitializedError` before ``init()``."""
    rt = _runtime
    if rt is None:
        raise NotInitializedError(what)
    return rt


def rank() -> int:
    """This process's rank in [0, size).  Mirrors ``horovod.tensorflow.rank``."""
    return runtime("rank()").topology.rank


def size() -> int:
    """Number of processes in the job.  Mirrors ``horovod.tensorflow.size``."""
    return runtime("size()").topology.size


def local_rank() -> int:
    """Rank among the processes on this host.  Mirrors ``horovod.tensorflow.local_rank``."""
    return runtime("local_rank()").topology.local_rank


def local_size() -> int:
    """Number of processes on this host.  Mirrors ``horovod.tensorflow.local_size``."""
    return runtime("local_size()").topology.local_size


def cross_rank() -> int:
    """Index of this host among hosts.  Mirrors ``horovod.tensorflow.cross_rank``."""
    return runtime("cross_rank()").topology.cross_rank


def cross_size() -> int:
    """Number of hosts.  Mirrors ``horovod.tensorflow.cross_size``."""
    return runtime("cross_size()").topology.cross_size


def has_wire() -> bool:
    """True when collectives cross a network (ranks on several hosts); False for one process or
    when every rank shares this host's memory.  Used to skip wire compression where it cannot pay."""
    rt = runtime("has_wire()")
    return rt.size > 1 and rt.mesh.shm is None


def auto_name(kind: str) -> str:
    """A name from a per-process, per-kind counter: ``allreduce.noname.7``."""
    with _counter_lock:
        c = _counters.setdefault(kind, itertools.count())
        return f"{kind}.noname.{next(c)}"


def _submit(kind, tensor, name, **kw) -> Handle:
    rt = runtime(f"{kind}()")
    return rt.submit(Request(name or auto_name(kind), kind, np.asarray(tensor), **kw))


def allreduce_async(tensor, name: Optional[str] = None, op=None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, out: Optional[np.ndarray] = None) -> Handle:
    """Start an allreduce of ``tensor`` (numpy array, any shape) and return a handle.

    ``op``: :class:`ReduceOp` (default AVERAGE).  Scale factors multiply before / after reduction.
    The result has the shape and dtype of ``tensor``; it is written into ``out`` when given (a
    preallocated array of that shape and dtype, which may be ``tensor`` itself: in place, like
    ``horovod.torch.allreduce_``), else into a new array.
    Mirrors ``horovod.torch.allreduce_async``.  Raises ``ValueError`` for an unusable ``out`` or
    an unsupported dtype/op (see the module docstring)."""
    return _submit("allreduce", tensor, name, op=resolve_op(op), prescale=prescale_factor,
                   postscale=postscale_factor, out=out)


def allreduce(tensor, name: Optional[str] = None, op=None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Reduce ``tensor`` across all ranks (default: average) and return the result everywhere
    (``out`` if given, see :func:`allreduce_async`).

    Shape, dtype, op and scale factors must agree on every rank, otherwise every rank raises
    :class:`TensorMismatchError`.  Mirrors ``horovod.tensorflow.allreduce`` on numpy arrays."""
    return allreduce_async(tensor, name, op, prescale_factor, postscale_factor, out).wait()


def grouped_allreduce_async(tensors: Sequence, names: Optional[Sequence[str]] = None, op=None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> List[Handle]:
    """Submit allreduces of several arrays in one batch (scheduled and fused together);
    ``names`` defaults to ``<auto>.0``, ``<auto>.1``, ...  Returns one handle per array."""
    if names is None:
        base = auto_name("grouped_allreduce")
        names = [f"{base}.{i}" for i in range(len(tensors))]
    op = resolve_op(op)
    reqs = [Request(n, "allreduce", np.asarray(t), op=op, prescale=prescale_factor, postscale=postscale_factor)
            for t, n in zip(tensors, names)]
    return runtime("grouped_allreduce()").submit_many(reqs) if reqs else []


def grouped_allreduce(tensors: Sequence, name: Optional[str] = None, op=None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> List[np.ndarray]:
    """Allreduce a list of arrays as one unit (they are fused together where dtypes allow).

    Mirrors ``horovod.tensorflow.grouped_allreduce``."""
    names = None if name is None else [f"{name}.{i}" for i in range(len(tensors))]
    return [h.wait() for h in grouped_allreduce_async(tensors, names, op, prescale_factor, postscale_factor)]


def grouped_broadcast_async(tensors: Sequence, root_rank: int, names: Sequence[str]) -> List[Handle]:
    """Submit broadcasts of several arrays from ``root_rank`` in one batch; one handle each."""
    reqs = [Request(n, "broadcast", np.asarray(t), root=int(root_rank)) for t, n in zip(tensors, names)]
    return runtime("broadcast()").submit_many(reqs) if reqs else []


def allgather_async(tensor, name: Optional[str] = None) -> Handle:
    """Start an allgather; see :func:`allgather`."""
    return _submit("allgather", tensor, name)


def allgather(tensor, name: Optional[str] = None) -> np.ndarray:
    """Concatenate every rank's ``tensor`` along the first dimension, in rank order.

    The first dimension may differ per rank; all other dimensions and the dtype must agree.
    Mirrors ``horovod.tensorflow.allgather``."""
    return allgather_async(tensor, name).wait()


def grouped_allgather(tensors: Sequence, name: Optional[str] = None) -> List[np.ndarray]:
    """Allgather each array of a list.  Mirrors ``horovod.tensorflow.grouped_allgather``."""
    base = name or auto_name("grouped_allgather")
    handles = [allgather_async(t, f"{base}.{i}") for i, t in enumerate(tensors)]
    return [h.wait() for h in handles]


def broadcast_async(tensor, root_rank: int, name: Optional[str] = None) -> Handle:
    """Start a broadcast; see :func:`broadcast`."""
    return _submit("broadcast", tensor, name, root=int(root_rank))


def broadcast(tensor, root_rank: int, name: Optional[str] = None) -> np.ndarray:
    """Return ``root_rank``'s ``tensor`` on every rank.  Shape and dtype must agree; a
    ``root_rank`` outside [0, size) raises :class:`TensorMismatchError` on every rank.
    Mirrors ``horovod.tensorflow.broadcast``."""
    return broadcast_async(tensor, root_rank, name).wait()


def alltoall(tensor, splits=None, name: Optional[str] = None):
    """Send ``splits[j]`` rows of ``tensor`` (in order) to rank j; return ``(received, received_splits)``.

    ``splits`` defaults to an equal split of the first dimension (which must then divide by
    size).  Mirrors ``horovod.tensorflow.alltoall``."""
    arr = np.asarray(tensor)
    n = runtime("alltoall()").size
    if splits is None:
        dim0 = arr.shape[0] if arr.ndim else 0
        splits = [dim0 // n] * n if dim0 % n == 0 else None
    return _submit("alltoall", arr, name, splits=None if splits is None else list(np.asarray(splits).ravel())
                   ).wait()


def reducescatter(tensor, name: Optional[str] = None, op=None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> np.ndarray:
    """Reduce ``tensor`` across ranks and return this rank's share of the first dimension
    (split as evenly as possible, lower ranks get the extra rows).
    Mirrors ``horovod.tensorflow.reducescatter``.  Raises ``ValueError`` for a scalar or an
    unsupported dtype/op (see the module docstring)."""
    op = resolve_op(op)
    return _submit("reducescatter", tensor, name, op=op, prescale=prescale_factor,
                   postscale=postscale_factor).wait()


def join() -> int:
    """Declare that this rank has no more data: until every rank has joined, its part of the
    other ranks' allreduces (SUM/AVERAGE) is zeros.  Blocks until all ranks joined; returns the
    rank that joined last.  Other collectives involving a joined rank raise
    :class:`TensorMismatchError` on every rank.  Mirrors ``horovod.tensorflow.join``."""
    from sdp.engine.coordinator import JOIN
    return _submit("join", np.zeros(0, np.uint8), JOIN).wait()


def barrier() -> None:
    """Block until every rank reaches the barrier.  Mirrors ``horovod.tensorflow.barrier``."""
    allreduce(np.zeros(1, np.int32), name=auto_name("barrier"), op=ReduceOp.SUM)


def broadcast_object(obj, root_rank: int = 0, name: Optional[str] = None):
    """Pickle ``obj`` on ``root_rank`` and return it on every rank.
    Mirrors ``horovod.tensorflow.broadcast_object``."""
    me = runtime("broadcast_object()").rank
    base = name or auto_name("broadcast_object")
    payload = np.frombuffer(pickle.dumps(obj), np.uint8) if me == root_rank else np.zeros(0, np.uint8)
    length = broadcast(np.array([payload.size], np.int64), root_rank, f"{base}.len")
    buf = payload if me == root_rank else np.zeros(int(length[0]), np.uint8)
    data = broadcast(buf, root_rank, f"{base}.data")
    return obj if me == root_rank else pickle.load(io.BytesIO(data.tobytes()))


def allgather_object(obj, name: Optional[str] = None) -> list:
    """Pickle ``obj`` on every rank and return the list of all ranks' objects, in rank order.
    Mirrors ``horovod.tensorflow.allgather_object``."""
    base = name or auto_name("allgather_object")
    payload = np.frombuffer(pickle.dumps(obj), np.uint8)
    lengths = allgather(np.array([payload.size], np.int64), f"{base}.len")
    data = allgather(payload, f"{base}.data")
    out, off = [], 0
    for n in lengths:
        out.append(pickle.loads(data[off:off + int(n)].tobytes()))
        off += int(n)
    return out

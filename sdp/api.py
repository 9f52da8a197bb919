"""Framework-free API on numpy arrays: the layer every face (TensorFlow, KungFu) is built on.

``init()`` reads the topology from the environment (see ``sdp.common.topology``), meets the
other ranks and starts the engine.  Collectives come in ``*_async`` forms returning a
``Handle`` and synchronous forms returning numpy arrays.

Names identify a collective across ranks: ranks may submit in different orders, and the engine
matches them by name.  Without a ``name``, one is generated from a per-process counter, which
matches across ranks when every rank makes the same unnamed calls in the same order.
``send``/``recv`` are point to point between two ranks (no name: a rank and a tag).

Process sets (Horovod's ``process_set=``): every collective takes ``process_set``, a set id (int)
or an object with a ``process_set_id`` (``sdp.process_sets.ProcessSet``); 0, the default,
is the whole job.  Only the set's ranks call a set's collective (another rank gets ``ValueError``
naming the set and the rank, at once); roots (broadcast) are job ranks in the set; allgather
concatenates and alltoall splits in the set's rank order; AVERAGE divides by the set's size.
Sets are added with ``add_process_sets`` on every rank alike; see
``sdp.engine.process_sets`` for how they are negotiated and run.

Dtypes: reductions (allreduce, reducescatter) take bool (SUM/MAX: logical or, MIN/PRODUCT:
logical and; no AVERAGE, no scale factors), int8/16/32/64, uint8-64, float16, bfloat16, float32
and float64 (16-bit floats are summed and scaled in float32 and rounded once); allgather,
broadcast and alltoall move any dtype without Python objects.  Anything else raises
``ValueError`` on the calling rank when submitted, before any other rank is involved; a
disagreement between ranks raises ``TensorMismatchError`` on every rank.

``op=Adasum`` (Horovod's adaptive summation, ``sdp.engine.adasum``; ``ReduceOp.ADASUM``):
allreduces of float16, float32 and float64 only (else ``ValueError``), of the global process set
of a power-of-two number of ranks (else ``NotImplementedError`` with Horovod's text, on every
calling rank at once); no averaging (a postscale still applies).  Always run by the engine
thread, never by the fast lane, inline or the leaders' link (they combine elementwise); device
arrays are staged through host memory for it.  With ``SDP_HIERARCHICAL=1`` across hosts, the
ranks of a host average and the hosts' averages are combined (Horovod's NCCL build), which
needs a power-of-two number of hosts.

Device arrays: every collective also takes arrays in CUDA memory: PyCUDA ``GPUArray``s, objects
with ``__cuda_array_interface__`` (CuPy, PyTorch; the engine waits on the stream they name), DLPack
producers (``__dlpack__``) and raw ``dltensor`` capsules (``tf.experimental.dlpack.to_dlpack``).
They are reduced on the device (``sdp.engine.device_path``: CUDA IPC between the ranks of one
host, else staged through host memory) and come back as the input's own kind: a ``GPUArray``, the
producer module's ``from_dlpack`` of the result (a ``torch.Tensor``, a CuPy array), or a new
capsule.  Device arrays must be C-contiguous; ``out=`` is host only.  All ranks must pass device
arrays, or all host arrays, for a name (else ``TensorMismatchError``).
A CPU DLPack capsule is read as a numpy array.  A DLPack producer in host memory that is not a
numpy array is read through ``np.from_dlpack`` (no copy), and ``allreduce``, ``allgather``,
``broadcast``, ``alltoall`` and ``reducescatter`` give its result back through its module's
``from_dlpack`` (numpy where the module has none); the other calls return numpy arrays.
"""
import atexit
import io
import itertools
import logging
import pickle
import threading
from typing import List, Optional, Sequence

import numpy as np

from sdp.common import blas_threads
from sdp.common import topology as _topology
from sdp.common.config import Config
from sdp.common.errors import NotInitializedError
from sdp.common.reduce_ops import ReduceOp, resolve_op
from sdp.engine.device_arrays import host_result
from sdp.engine.process_sets import MAX_SET_ID
from sdp.engine.handles import Handle
from sdp.engine.p2p import MAX_TAG as _MAX_TAG
from sdp.engine.dispatch import as_input
from sdp.engine.request import Request
from sdp.engine.runtime import Runtime
from sdp.transport import lifeline

_lock = threading.Lock()
_runtime: Optional[Runtime] = None
_counters = {}
_counter_lock = threading.Lock()
"""Mean bytes per array up to which ``grouped_allreduce_async`` flattens host arrays into one
request (packing them costs the caller a copy the engine would make anyway; above it, the
engine's own fusion packs straight into shared memory, which saves a pass over the bytes)."""
_set_ids = itertools.count(1)  # ids of process sets, in the order they are added (the same on every rank)


def _setup_logging() -> None:
    """The ``sdp`` logger's level from ``SDP_LOG_LEVEL`` (default WARNING), whatever the root
    logger's level: a script's ``logging.basicConfig(level=logging.DEBUG)`` (KungFu's Keras
    example) must not turn on sdp's debug lines.  A level set on the ``sdp`` logger itself before
    ``init()`` is kept unless ``SDP_LOG_LEVEL`` is given.  Raises ``ValueError`` naming the
    variable for an unknown level (``sdp.common.config.log_level_from_env``)."""
    from sdp.common.config import log_level_from_env
    level = log_level_from_env()
    logger = logging.getLogger("sdp")
    if level is not None or logger.level == logging.NOTSET:
        logger.setLevel("WARNING" if level is None else level)
    if not logger.handlers and not logging.getLogger().handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        logger.addHandler(h)


def init(config: Optional[Config] = None) -> None:
    """Start sdp in this process: read the topology, rendezvous with all ranks, start the engine.

    Mirrors ``horovod.tensorflow.init``: a call while sdp is initialized returns at once and
    changes nothing (``config`` included), Horovod's rule; SMDDP's names (``sdp.compat_smddp``)
    raise ``AlreadyInitializedError`` there instead, as SMDDP documents.  After ``shutdown()`` it
    initializes again.  Raises ``TopologyError`` for a bad environment, one ``ValueError`` naming every
    ``SDP_*``/``HOROVOD_*`` setting whose value is not allowed (``sdp.common.config.check_env``), ``RendezvousError`` if the other ranks do
    not show up within ``SDP_START_TIMEOUT`` seconds."""
    global _runtime, _set_ids
    with _lock:
        if _runtime is not None:
            return
        cfg = config or Config.from_env()  # first: one ValueError naming every setting not allowed
        _setup_logging()
        lifeline.watch_launcher()  # end with sdprun, however it ends
        _runtime = Runtime(_topology.from_env(), cfg)
        blas_threads.share_cores(_runtime.topology.local_size)
        if cfg.timeline:
            from sdp.engine import timeline
            timeline.start(_runtime, cfg.timeline)
        _counters.clear()
        _set_ids = itertools.count(1)


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
    ``sdp.common.config.bucket_cap_mb_to_bytes``.  Raises ``ValueError`` if negative."""
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
    """The engine of this process; raises ``NotInitializedError`` before ``init()``."""
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


AUTO_NAMES = 1024
"""Distinct automatic names per kind of collective before the counter wraps (as Horovod's response
cache capacity, 1024)."""


def auto_name(kind: str, process_set=0) -> str:
    """A name from a per-process, per-kind (and per process set) counter modulo ``AUTO_NAMES``:
    ``allreduce.noname.7``.  Every rank makes the same names in the same order; names come back
    after ``AUTO_NAMES`` calls, so the engine's response caches stay bounded in a loop of unnamed
    collectives (unique names grew memory ~124 KB per step).  So at most ``AUTO_NAMES`` unnamed
    collectives of one kind can be in flight at once (more: ``ValueError`` naming the name)."""
    with _counter_lock:
        c = _counters.setdefault((kind, process_set) if process_set else kind, itertools.count())
        return f"{kind}.noname.{next(c) % AUTO_NAMES}"


def process_set_id(process_set) -> int:
    """The id of ``process_set``: None or 0 -> 0 (all ranks), an int as is, else its
    ``process_set_id`` (``ValueError`` if that is None: a set not registered or removed)."""
    if process_set is None:
        return 0
    if isinstance(process_set, (int, np.integer)) and not isinstance(process_set, bool):
        return int(process_set)
    ps = getattr(process_set, "process_set_id", None)
    if ps is None:
        raise ValueError(f"{process_set}: not a registered process set (pass it to init(process_sets=...) or "
                         "add_process_set() first; a removed set cannot be used)")
    return int(ps)


def _set_name(rt: Runtime, kind: str, name: Optional[str], process_set) -> tuple:
    """``(engine name, set id)`` of a collective on ``process_set``: the name is ``<name>@ps<id>``
    for sets other than the global one.  Raises ``ValueError`` when this rank is not in the set
    or the set is not registered."""
    ps = _check_set(rt, kind, name, process_set)
    return (f"{name or auto_name(kind, ps)}@ps{ps}" if ps else name or auto_name(kind)), ps


def _check_set(rt: Runtime, kind: str, name: Optional[str], process_set) -> int:
    """The id of ``process_set`` after checking that it is registered and holds this rank."""
    ps = process_set_id(process_set)
    if not ps:
        return 0
    ranks = rt.process_sets.get(ps)
    if ranks is None:
        raise ValueError(f"{kind}: process set {ps} is not registered on rank {rt.rank} (registered: "
                         f"{sorted(rt.process_sets)})")
    if rt.rank not in ranks:
        raise ValueError(f"{kind}{f' of {name!r}' if name else ''}: rank {rt.rank} is not in process set {ps} "
                         f"(ranks {ranks}); only the set's ranks may call its collectives")
    return ps


def device_counters() -> dict:
    """What the device path did in this process: bytes copied device-to-host (``d2h``),
    host-to-device (``h2d``), device-to-device (``d2d``), kernels launched, whether the CUDA IPC
    path is in use (``ipc``), whether it runs per host with parts allreduced across hosts
    (``hierarchical``), the backend's name and how many device allreduces the fast lane ran in
    the calling thread (``lane``).  For tests and benchmarks."""
    return runtime("device_counters()").device_counters()


def _submit(kind, tensor, name, process_set=0, **kw) -> Handle:
    rt, name, ps = _engine_and_name(kind, name, process_set)
    return rt.dispatch.submit(Request(name, kind, as_input(tensor), ps=ps, **kw))


def _engine_and_name(kind: str, name: Optional[str], process_set) -> tuple:
    """``(runtime, engine name, set id)`` of a collective (see ``_set_name``)."""
    rt = _runtime
    if rt is None:
        raise NotInitializedError(f"{kind}()")
    if name is not None and (process_set is None or type(process_set) is int and not process_set):
        return rt, name, 0  # (a named collective of every rank: the common case, ~1.5 us less)
    return (rt, *_set_name(rt, kind, name, process_set))


def allreduce_async(tensor, name: Optional[str] = None, op=None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, out: Optional[np.ndarray] = None, process_set=0) -> Handle:
    """Start an allreduce of ``tensor`` (numpy array, any shape) and return a handle.

    ``op``: ``ReduceOp`` (default AVERAGE).  Scale factors multiply before / after reduction.
    The result has the shape and dtype of ``tensor``; it is written into ``out`` when given (a
    preallocated array of that shape and dtype, which may be ``tensor`` itself: in place, like
    ``horovod.torch.allreduce_``), else into a new array.
    Mirrors ``horovod.torch.allreduce_async``.  Raises ``ValueError`` for an unusable ``out`` or
    an unsupported dtype/op (see the module docstring)."""
    rt, ps = _runtime, 0
    if rt is None or name is None or not (process_set is None or type(process_set) is int and not process_set):
        rt, name, ps = _engine_and_name("allreduce", name, process_set)  # (else inline: ~0.1 us less a call)
    op = op if type(op) is ReduceOp else resolve_op(op)
    return rt.dispatch.allreduce_async(name, tensor, op, prescale_factor, postscale_factor, out, ps)


def allreduce(tensor, name: Optional[str] = None, op=None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, out: Optional[np.ndarray] = None, process_set=0) -> np.ndarray:
    """Reduce ``tensor`` across all ranks (default: average) and return the result everywhere
    (``out`` if given, see ``allreduce_async``).

    Shape, dtype, op and scale factors must agree on every rank, otherwise every rank raises
    ``TensorMismatchError``.  Mirrors ``horovod.tensorflow.allreduce`` on numpy arrays."""
    rt, name, ps = _engine_and_name("allreduce", name, process_set)
    op = op if type(op) is ReduceOp else resolve_op(op)
    result = rt.dispatch.allreduce(name, tensor, op, prescale_factor, postscale_factor, out, ps)
    return result if type(tensor) is np.ndarray else host_result(tensor, result)  # (a host DLPack producer
    # gets its own kind back)


def allreduce_front():
    """The compiled entry of ``allreduce`` (the first path ``Dispatch.allreduce`` tries), for a
    face's hot path, or None where there is none (not initialized, no fast lane, one rank).

    ``front(name, array, op, postscale, out)`` takes what ``Dispatch.allreduce`` gives it: an
    engine ``name`` of the global set (``str``), a C-contiguous numpy ``array``, a ``ReduceOp``
    other than ``Adasum``, ``postscale`` (a number; the prescale is 1.0) and ``out`` (a
    preallocated array or None).  It returns the result as ``allreduce`` would, or None where the
    call must go through ``allreduce`` instead (a name not learnt yet, the lane busy, a peer
    late): a face that gets None calls ``allreduce`` with the same arguments.  Raises what
    ``allreduce`` raises for a learnt name (``TensorMismatchError`` and the other ``SdpError``
    classes)."""
    rt = _runtime
    return None if rt is None else rt.front


def check_adasum(process_set=0) -> None:
    """Raise what an allreduce with ``op=Adasum`` of ``process_set`` raises on this rank before
    anything is sent: ``NotImplementedError`` with Horovod's text for a process set other than
    the global one, or a number of ranks that is not a power of two (of hosts, where Adasum runs
    hierarchically: ``SDP_HIERARCHICAL=1`` across hosts).  For faces that check when a graph is
    built, as Horovod's ``allreduce`` does."""
    rt = runtime("check_adasum()")
    rt.check_adasum(process_set_id(process_set))


def grouped_allreduce_async(tensors: Sequence, names: Optional[Sequence[str]] = None, op=None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set=0) -> List[Handle]:
    """Submit allreduces of several arrays in one batch (scheduled and fused together);
    ``names`` defaults to ``<auto>.0``, ``<auto>.1``, ...  Returns one handle per array.

    Host arrays of at most ``sdp.engine.grouped.GROUP_MEAN_BYTES`` (64 KB) bytes on average go to the engine as one
    request per dtype (a flattened group, ``Request.group``): one negotiation, one cache
    entry and one handle for the lot, where per-array requests cost ~10 us each.  Every rank must
    then pass the same shapes in the same order (else ``TensorMismatchError`` naming the
    group by its first name and count; a timeline shows the group under that name, without
    the FUSE and UNPACK phases, which happen outside the engine); larger arrays go one request
    each, fused by the engine.  Groups are cut at the fusion threshold (0: one request per
    array), so ranks must use the same threshold.  With every rank on this host, one group of
    every array runs in the calling thread while the fast lane is idle, as
    ``grouped_allreduce`` does, for up to the lane's spin (200 us) if a peer has not
    submitted it yet; then it is posted and the handles are returned as usual."""
    return _grouped(tensors, names, op, prescale_factor, postscale_factor, process_set, False)


def _grouped(tensors, names, op, prescale_factor, postscale_factor, process_set, wait: bool):
    """The grouped entry of the engine (``Dispatch.grouped_allreduce``) with the names resolved:
    ``<auto>.<i>`` where None, ``<name>@ps<id>`` in a process set."""
    rt = runtime("grouped_allreduce()")
    ps = _check_set(rt, "grouped_allreduce", None, process_set)
    if names is None:
        base = auto_name("grouped_allreduce", ps)
        names = [f"{base}.{i}" for i in range(len(tensors))]
    if ps:
        names = [f"{n}@ps{ps}" for n in names]
    elif type(names) is not list:
        names = list(names)
    op = op if type(op) is ReduceOp else resolve_op(op)
    return rt.dispatch.grouped_allreduce(names, tensors, op, prescale_factor, postscale_factor, ps, wait)


def grouped_allreduce(tensors: Sequence, name: Optional[str] = None, op=None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set=0) -> List[np.ndarray]:
    """Allreduce a list of arrays as one unit (they are fused together where dtypes allow).

    Mirrors ``horovod.tensorflow.grouped_allreduce``."""
    names = None
    if name is not None:
        names = _member_names.get((name, len(tensors)))
        if names is None:
            if len(_member_names) >= _MEMBER_NAMES_MAX:
                _member_names.clear()
            names = _member_names[(name, len(tensors))] = [f"{name}.{i}" for i in range(len(tensors))]
    return grouped_allreduce_named(tensors, names, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_named(tensors: Sequence, names: Optional[Sequence[str]], op=None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set=0) -> List[np.ndarray]:
    """``grouped_allreduce`` with each array's name given (as ``grouped_allreduce_async``
    takes them), waited at once: one array is one ``allreduce``; with every rank on this host
    a group of small arrays may run whole in the calling thread (the fast lane)."""
    if len(tensors) == 1 and names is not None:
        return [allreduce(tensors[0], names[0], op, prescale_factor, postscale_factor, None, process_set)]
    return _grouped(tensors, names, op, prescale_factor, postscale_factor, process_set, True)


_MEMBER_NAMES_MAX = 1024
_member_names = {}  # (name, count) -> the names grouped_allreduce gives the arrays


def grouped_broadcast_async(tensors: Sequence, root_rank: int, names: Sequence[str],
                            process_set=0) -> List[Handle]:
    """Submit broadcasts of several arrays from ``root_rank`` (a job rank) in one batch; one handle each."""
    rt = runtime("broadcast()")
    ps = _check_set(rt, "broadcast", names[0] if names else None, process_set)
    reqs = [Request(f"{n}@ps{ps}" if ps else n, "broadcast", as_input(t), root=int(root_rank), ps=ps)
            for t, n in zip(tensors, names)]
    return rt.dispatch.submit_many(reqs) if reqs else []


def allgather_async(tensor, name: Optional[str] = None, process_set=0) -> Handle:
    """Start an allgather; see ``allgather``."""
    return _submit("allgather", tensor, name, process_set)


def allgather(tensor, name: Optional[str] = None, process_set=0) -> np.ndarray:
    """Concatenate every rank's ``tensor`` along the first dimension, in rank order.

    The first dimension may differ per rank; all other dimensions and the dtype must agree.
    Mirrors ``horovod.tensorflow.allgather``."""
    return host_result(tensor, allgather_async(tensor, name, process_set).wait())


def grouped_allgather(tensors: Sequence, name: Optional[str] = None, process_set=0) -> List[np.ndarray]:
    """Allgather each array of a list.  Mirrors ``horovod.tensorflow.grouped_allgather``."""
    base = name or auto_name("grouped_allgather", process_set_id(process_set))
    handles = [allgather_async(t, f"{base}.{i}", process_set) for i, t in enumerate(tensors)]
    return [h.wait() for h in handles]


def broadcast_async(tensor, root_rank: int, name: Optional[str] = None, process_set=0) -> Handle:
    """Start a broadcast; see ``broadcast``."""
    return _submit("broadcast", tensor, name, process_set, root=int(root_rank))


def broadcast(tensor, root_rank: int, name: Optional[str] = None, process_set=0) -> np.ndarray:
    """Return ``root_rank``'s ``tensor`` on every rank.  Shape and dtype must agree; a
    ``root_rank`` outside [0, size) raises ``TensorMismatchError`` on every rank.
    Mirrors ``horovod.tensorflow.broadcast``."""
    return host_result(tensor, broadcast_async(tensor, root_rank, name, process_set).wait())


def alltoall_async(tensor, splits=None, name: Optional[str] = None, process_set=0) -> Handle:
    """Start an alltoall; the handle's result is ``(received, received_splits)`` (see ``alltoall``).
    Mirrors ``horovod.torch.alltoall_async``."""
    arr = as_input(tensor)
    rt = runtime("alltoall()")
    ps = process_set_id(process_set)
    n = len(rt.process_sets.get(ps, ())) if ps else rt.size
    if splits is None and n:
        dim0 = arr.shape[0] if arr.ndim else 0
        splits = [dim0 // n] * n if dim0 % n == 0 else None
    return _submit("alltoall", arr, name, ps, splits=None if splits is None else list(np.asarray(splits).ravel()))


def alltoall(tensor, splits=None, name: Optional[str] = None, process_set=0):
    """Send ``splits[j]`` rows of ``tensor`` (in order) to rank j; return ``(received, received_splits)``.

    ``splits`` defaults to an equal split of the first dimension (which must then divide by
    size).  Mirrors ``horovod.tensorflow.alltoall``."""
    received, received_splits = alltoall_async(tensor, splits, name, process_set).wait()
    return host_result(tensor, received), received_splits


def reducescatter_async(tensor, name: Optional[str] = None, op=None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, process_set=0) -> Handle:
    """Start a reducescatter; see ``reducescatter``.  Mirrors ``horovod.torch.reducescatter_async``."""
    return _submit("reducescatter", tensor, name, process_set, op=resolve_op(op), prescale=prescale_factor,
                   postscale=postscale_factor)


def reducescatter(tensor, name: Optional[str] = None, op=None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, process_set=0) -> np.ndarray:
    """Reduce ``tensor`` across ranks and return this rank's share of the first dimension
    (split as evenly as possible, lower ranks get the extra rows).
    Mirrors ``horovod.tensorflow.reducescatter``.  Raises ``ValueError`` for a scalar or an
    unsupported dtype/op (see the module docstring)."""
    return host_result(tensor, reducescatter_async(tensor, name, op, prescale_factor, postscale_factor,
                                                   process_set).wait())


def _set_ranks(ranks, size: int) -> List[int]:
    try:
        out = sorted(ranks)
    except TypeError:
        out = None
    if (not out or any(not isinstance(r, (int, np.integer)) or isinstance(r, bool) or not 0 <= r < size
                       for r in out) or len(set(out)) != len(out)):
        raise ValueError(f"a process set is a non-empty list of distinct ranks in [0, {size}), got {ranks!r}")
    return [int(r) for r in out]


def _peer(rt: Runtime, peer, kind: str, role: str) -> int:
    if type(peer) is not int and not isinstance(peer, np.integer) or not 0 <= peer < rt.size or peer == rt.rank:
        raise ValueError(f"{kind} on rank {rt.rank}: {role} {peer!r} is not another rank of the job "
                         f"(0 to {rt.size - 1}, not {rt.rank})")
    return int(peer)


def _tag(tag, kind: str) -> int:
    if type(tag) is not int and not isinstance(tag, np.integer) or not 0 <= tag <= _MAX_TAG:
        raise ValueError(f"{kind}: tag {tag!r} is not an int from 0 to {_MAX_TAG}")
    return int(tag)


def send(tensor, dst: int, tag: int = 0) -> Handle:
    """Start sending ``tensor`` (a host array of any shape and dtype; not C-contiguous ones are
    copied first) to rank ``dst``; returns a handle whose ``wait()`` returns None once the
    array may be changed again.  Rank ``dst`` receives it with ``recv(out, src=<this rank>,
    tag=tag)`` into an array of the same number of bytes; messages of one rank and tag are
    received in the order sent.  No other rank takes part, nothing is negotiated.  Mirrors
    ``torch.distributed.isend`` (the ``sdp`` backend's ``send`` is this).  Raises
    ``ValueError`` for ``dst`` not another rank or a tag outside 0 to 2**32 - 1; the handle
    raises ``PeerLostError`` if ``dst`` is lost."""
    rt = runtime("send()")
    arr = np.ascontiguousarray(tensor)
    return rt.submit_p2p(True, arr, _peer(rt, dst, "send", "dst"), _tag(tag, "send"))


def recv(out: np.ndarray, src: int, tag: int = 0) -> Handle:
    """Start receiving into ``out`` (a writeable C-contiguous numpy array) what rank ``src`` sent
    with ``send(..., dst=<this rank>, tag=tag)``; returns a handle whose ``wait()`` returns
    ``out`` once the message is in it.  Mirrors ``torch.distributed.irecv`` (the ``sdp``
    backend's ``recv`` is this).  Raises ``ValueError`` for ``out`` not such an array, ``src``
    not another rank or a tag outside 0 to 2**32 - 1; the handle raises
    ``TensorMismatchError`` when the message's byte count is not ``out.nbytes`` (naming both
    ranks, the tag and both sizes; the message is dropped) and ``PeerLostError`` if ``src`` is
    lost first."""
    rt = runtime("recv()")
    if type(out) is not np.ndarray or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"recv on rank {rt.rank}: out must be a writeable C-contiguous numpy array, "
                         f"not {type(out).__name__}")
    return rt.submit_p2p(False, out, _peer(rt, src, "recv", "src"), _tag(tag, "recv"))


def add_process_sets(rank_lists: Sequence[Sequence[int]]) -> List[int]:
    """Register process sets, each given by its job ranks, and return their ids (1, 2, ... in the
    order sets are added in this job).  A collective over all ranks: every rank calls it with the
    same lists in the same order (a set's collectives need it registered on every rank, members
    or not), and it returns once every rank has registered them.

    Raises ``ValueError`` on every rank when a list is empty, holds ranks outside ``[0, size)`` or
    twice, repeats another set (given, already registered, or the global set: all ranks), or when
    the ranks pass different lists (naming the ranks that differ).  Mirrors the registration of
    ``horovod.tensorflow.init(process_sets=...)`` and ``add_process_set``."""
    rt = runtime("add_process_set()")
    given = [list(r) if isinstance(r, (list, tuple, range)) else r for r in rank_lists]
    theirs = allgather_object(given, name=auto_name("add_process_sets"))
    differ = [r for r, t in enumerate(theirs) if t != theirs[0]]
    if differ:
        raise ValueError(f"add_process_set: ranks must register the same process sets in the same order; "
                         f"rank 0 has {theirs[0]!r}, " + ", ".join(f"rank {r} has {theirs[r]!r}" for r in differ))
    sets = [_set_ranks(r, rt.size) for r in given]
    known = {tuple(v): k for k, v in rt.process_sets.items()}
    known[tuple(range(rt.size))] = 0  # all ranks: the global set, as in Horovod
    for i, ranks in enumerate(sets):
        if tuple(ranks) in known or ranks in sets[:i]:
            raise ValueError(f"process set {ranks} is a duplicate (of process set "
                             f"{known.get(tuple(ranks), 'given before it')}); each set of ranks is registered once")
    ids = [next(_set_ids) for _ in sets]
    for ps, ranks in zip(ids, sets):
        if ps > MAX_SET_ID:
            raise ValueError(f"too many process sets: ids go up to {MAX_SET_ID}")
        rt.add_process_set(ps, ranks)
    barrier()  # rank 0's coordinator knows the sets before any rank can use them
    return ids


def remove_process_set(process_set) -> bool:
    """Unregister a process set (id or object) on every rank; a collective over all ranks, called
    after the set's collectives completed.  Returns False (on every rank) for the global set or
    a set that is not registered.  Raises ``ValueError`` if the ranks name different sets."""
    rt = runtime("remove_process_set()")
    ps = process_set_id(process_set) if getattr(process_set, "process_set_id", 0) is not None else -1
    theirs = allgather(np.array([ps], np.int64), name=auto_name("remove_process_set"))
    if len(set(theirs.tolist())) > 1:
        raise ValueError(f"remove_process_set: the ranks named different process sets: {theirs.tolist()} "
                         "(in rank order)")
    if ps <= 0 or ps not in rt.process_sets:
        return False
    rt.remove_process_set(ps)
    return True


def process_set_ranks(process_set) -> Optional[List[int]]:
    """The job ranks of a registered process set (id or object), ascending; None if unknown."""
    rt = runtime("process_set_ranks()")
    ps = process_set_id(process_set)
    return list(range(rt.size)) if ps == 0 else rt.process_sets.get(ps)


def join() -> int:
    """Declare that this rank has no more data: until every rank has joined, its part of the
    other ranks' allreduces (SUM/AVERAGE) is zeros.  Blocks until all ranks joined; returns the
    rank that joined last.  Other collectives involving a joined rank raise
    ``TensorMismatchError`` on every rank.  With every rank on one host, small allreduces
    after it are as fast as before it (the join makes two 4-byte allreduces more, ~2 ms in
    all).  Mirrors ``horovod.tensorflow.join``."""
    from sdp.engine.coordinator import JOIN
    rt = runtime("join()")
    if rt.link is not None:  # (the path of sdp.engine.hostlink turns off on every rank)
        rt.link.join()
    last = _submit("join", np.zeros(0, np.uint8), JOIN).wait()
    if rt.lane is not None:  # (every rank's fast lane turned off at the join: on again, in step)
        rt.lane.rearm(lambda ok: int(allreduce(np.array([ok], np.int32), name="join.lane", op=ReduceOp.MIN)[0]))
    return last


def barrier(process_set=0) -> None:
    """Block until every rank (of ``process_set``) reaches the barrier.  Mirrors
    ``horovod.tensorflow.barrier``."""
    allreduce(np.zeros(1, np.int32), name=auto_name("barrier", process_set_id(process_set)), op=ReduceOp.SUM,
              process_set=process_set)


def broadcast_object(obj, root_rank: int = 0, name: Optional[str] = None, process_set=0):
    """Pickle ``obj`` on ``root_rank`` and return it on every rank (of ``process_set``).
    Mirrors ``horovod.tensorflow.broadcast_object``."""
    me = runtime("broadcast_object()").rank
    base = name or auto_name("broadcast_object", process_set_id(process_set))
    payload = np.frombuffer(pickle.dumps(obj), np.uint8) if me == root_rank else np.zeros(0, np.uint8)
    length = broadcast(np.array([payload.size], np.int64), root_rank, f"{base}.len", process_set)
    buf = payload if me == root_rank else np.zeros(int(length[0]), np.uint8)
    data = broadcast(buf, root_rank, f"{base}.data", process_set)
    return obj if me == root_rank else pickle.load(io.BytesIO(data.tobytes()))


def allgather_object(obj, name: Optional[str] = None, process_set=0) -> list:
    """Pickle ``obj`` on every rank (of ``process_set``) and return the list of their objects, in
    rank order.  Mirrors ``horovod.tensorflow.allgather_object``."""
    base = name or auto_name("allgather_object", process_set_id(process_set))
    payload = np.frombuffer(pickle.dumps(obj), np.uint8)
    lengths = allgather(np.array([payload.size], np.int64), f"{base}.len", process_set)
    data = allgather(payload, f"{base}.data", process_set)
    out, off = [], 0
    for n in lengths:
        out.append(pickle.loads(data[off:off + int(n)].tobytes()))
        off += int(n)
    return out

"""A ``torch.distributed`` backend named ``"sdp"``: PyTorch's process-group collectives on sdp's engine.

Importing this module (``import sdp.torch.distributed``) registers the backend with
``torch.distributed.Backend.register_backend("sdp", ..., devices=["cpu", "cuda"])``; then, in the
ranks ``sdprun`` starts::

    import torch.distributed as dist
    import sdp.torch.distributed  # noqa: F401  (registers "sdp")
    dist.init_process_group(backend="sdp")
    dist.all_reduce(t)                                   # on sdp's engine, no Gloo or NCCL
    model = torch.nn.parallel.DistributedDataParallel(model)

**Rendezvous.**  sdp's ranks find each other through ``sdprun``'s own rendezvous (``sdp.init()``,
which the backend calls if nothing did yet), so the backend needs no torch store.  When
``MASTER_ADDR`` is not set, ``init_method="env://"`` (the default) is answered from sdp's
environment (``sdp.common.topology``: ``sdprun``, ``mpirun``, Slurm, ..., or one process
without a launcher) instead of failing: rank and world size are sdp's and the store is a
``LocalStore`` (nothing listens on a port); ``init_method="sdp://"`` asks for that
explicitly.  A Gloo or NCCL group beside the sdp one (``dist.new_group(backend="gloo")``) needs a
store shared between the ranks: set ``MASTER_ADDR``/``MASTER_PORT`` (``sdprun -x``; ``env://``
then builds PyTorch's ``TCPStore`` as usual) or give ``init_method="file://..."``; without one
it raises ``RuntimeError`` saying so.  ``rank``/``world_size`` given to ``init_process_group`` must
be sdp's, else ``ValueError``.  Launched by ``torchrun``, or with ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT`` (Kubeflow's PyTorchJob), ``env://`` is PyTorch's ``TCPStore`` and
sdp meets at ``MASTER_ADDR:MASTER_PORT + 1`` beside it.

**Collectives.**  ``ProcessGroupSDP`` is a Python ``torch.distributed.ProcessGroup`` (the
kind PyTorch's own tests subclass).  Each collective is submitted to ``sdp.api``
asynchronously under the name ``torch.<group>.<n>``, ``n`` counting the group's collectives
modulo ``sdp.api.AUTO_NAMES``: ranks issue a group's collectives in the same order (PyTorch's
rule), so the n-th collective of every rank pairs up, and a rank whose n-th collective differs
(another kind, shape, dtype, op or root) gets ``TensorMismatchError``, as
does every other rank, raised from ``Work.wait()`` (and set on its future).  CPU tensors are
reduced in place through views of their memory (the in-place result is the caller's tensor);
CUDA tensors through sdp's device path.  Supported: ``allreduce`` (``ReduceOp`` SUM, AVG, MIN,
MAX, PRODUCT; BAND/BOR/BXOR/PREMUL_SUM raise ``ValueError``), ``allreduce_coalesced``,
``broadcast``, ``allgather``, ``all_gather_single`` (``all_gather_into_tensor``) and its coalesced
form, ``reduce_scatter``, ``reduce_scatter_single`` (``reduce_scatter_tensor``) and its
coalesced form, ``reduce``, ``gather``, ``scatter``, ``alltoall``, ``all_to_all_single``,
``barrier``, and point to point ``send``/``recv`` (``isend``/``irecv``: ``sdp.api.send``/``recv``, only
the two ranks take part; CUDA tensors go through host memory); ``recv`` from any source raises
``NotImplementedError``.

**Work and futures.**  Every collective returns a ``Work`` at once.  An allreduce that is
waited on at once (``async_op=False``), and, when every rank is on this host, one of a CPU tensor
of at most ``NOW_BYTES`` x (ranks - 1) (DDP's first bucket, a small model's only one) runs
whole in the calling thread through sdp's fast lane (no hand-over to the engine's thread), and
its ``Work`` is done when returned.  ``Work.wait()`` waits
(at most the group's ``timeout``, then ``CollectiveTimeoutError``);
``Work.get_future()`` (what DDP's reducer and comm hooks use) returns a ``torch.futures.Future``
that one background thread per process completes, in submission order, with the output tensors
(or the error).  A ``then()`` callback runs on that thread: a collective it starts is completed
there when the callback asks for its future (PowerSGD's hook waits on it at once); it must not
block on the future of a collective started outside the callback.

**Subgroups.**  ``dist.new_group(ranks)`` with the default group on this backend is an sdp
process set of ``ranks`` (``sdp.api.add_process_sets``, on every rank: PyTorch's rule that
every rank calls ``new_group`` makes that possible through the default group's ``new_group``
hook); over every rank it is a group of its own on the whole job.  Made on its members only
(``use_local_synchronization=True``, or beside a default group of another backend), a strict
subset raises ``NotImplementedError`` there; so does ``sort_ranks=False`` with ranks out of order.

Mirrors ``torch.distributed``'s ``ProcessGroup``/``Work`` contract (c10d) as PyTorch 2.x's
``ProcessGroupGloo`` fulfils it for CPU tensors.
"""
import datetime
import itertools
import logging
import os
import queue
import sys
import threading
from typing import Callable, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future

import sdp.api as api
from sdp.torch import tensors as _tensors
from sdp.common.reduce_ops import ReduceOp

log = logging.getLogger("sdp.torch.distributed")
BACKEND = "sdp"
"""The backend name this module registers with ``torch.distributed.Backend.register_backend``
(``init_process_group(backend="sdp")``, CPU and CUDA tensors)."""
NOW_BYTES = 1 << 20
"""Bytes (1 MiB): when every rank is on this host, an asynchronous allreduce of a CPU tensor of
at most this many bytes x (ranks - 1) runs whole in the calling thread (the fast lane's limit for
a synchronous allreduce) and its ``Work`` is done when returned; other asynchronous collectives
are handed to the engine's thread."""
SCHEME = "sdp"
"""The ``init_method`` scheme (``init_method="sdp://"``) answered from sdp's environment rather
than a URL (see the module docstring)."""

_OPS = {int(theirs): ours for theirs, ours in (  # (by the value of ReduceOp.RedOpType, a ReduceOp's .op)
    (dist.ReduceOp.SUM, ReduceOp.SUM), (dist.ReduceOp.AVG, ReduceOp.AVERAGE), (dist.ReduceOp.MIN, ReduceOp.MIN),
    (dist.ReduceOp.MAX, ReduceOp.MAX), (dist.ReduceOp.PRODUCT, ReduceOp.PRODUCT))}


def _reduce_op(op) -> ReduceOp:
    kind = getattr(op, "op", op)
    ours = _OPS.get(int(kind))
    if ours is None:
        raise ValueError(f"torch.distributed backend 'sdp': ReduceOp {kind} is not supported "
                         "(SUM, AVG, MIN, MAX and PRODUCT are)")
    return ours


# ---------------------------------------------------------------- Work

class _Completer:
    """One daemon thread per process that completes the futures of ``Work`` objects whose
    future was asked for, in submission order."""

    def __init__(self):
        self._queue: "queue.SimpleQueue[Work]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def put(self, work: "Work") -> None:
        """Complete ``work``'s future once it is done (after those put before it)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="sdp-torch-futures", daemon=True)
                self._thread.start()
        self._queue.put(work)

    def in_thread(self) -> bool:
        """Whether the caller is the completing thread."""
        return threading.current_thread() is self._thread

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            try:
                work._settle()
            except Exception:  # (a then() callback's own error is its future's; anything else: logged, go on)
                log.exception("completing the future of a torch.distributed collective on sdp")


_completer = _Completer()


class Work(dist._Work):
    """The pending result of one collective of ``ProcessGroupSDP`` (``torch.distributed``'s
    ``Work``): ``wait()``, ``get_future()``, ``is_completed()``, ``is_success()``,
    ``exception()``, ``result()``."""

    def __init__(self, handles: Sequence, finish: Callable[[list], list], outputs: list,
                 timeout: Optional[float], devices: Optional[list] = None):
        super().__init__()
        self._handles = list(handles)
        self._finish = finish
        self._outputs = outputs
        self._timeout = timeout
        self._devices = devices
        self._lock = threading.Lock()
        self._done = False
        self._error: Optional[BaseException] = None
        self._future: Optional[Future] = None

    def _complete(self) -> None:
        """Wait for the engine's results and write them into the output tensors, once."""
        with self._lock:
            if self._done:
                return
            try:
                results = [h.wait(self._timeout) for h in self._handles]
                self._finish(results)
            except BaseException as e:  # (every rank's error: mismatch, peer lost, timeout)
                self._error = e
            self._done = True
            self._handles = []

    def _settle(self) -> None:
        """Complete and set the future (the completer thread, or a wait on that thread)."""
        self._complete()
        fut = self._future
        if fut is not None and not fut.done():
            if self._error is not None:
                fut.set_exception(self._error)
            else:
                fut.set_result(self._outputs)

    def wait(self, timeout=None) -> bool:
        """Block until the collective is done; raise its error (e.g. ``TensorMismatchError``).
        ``timeout`` (a ``timedelta`` or seconds; 0 or None: the group's) bounds the wait: then
        ``CollectiveTimeoutError``."""
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if seconds:
            self._timeout = float(seconds)
        fut = self._future
        if fut is not None and not _completer.in_thread():
            fut.wait()  # (the completer thread drives it: one thread polls the engine's handle)
            return True
        self._settle()
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> Future:
        """A ``torch.futures.Future`` holding the list of output tensors once the collective is
        done (or its error)."""
        with self._lock:
            if self._future is None:
                self._future = Future(devices=self._devices) if self._devices else Future()
                fresh = True
            else:
                fresh = False
        if fresh:
            if self._done or _completer.in_thread():  # (asked in a then() callback, which may wait on it
                self._settle()                        # at once: PowerSGD's hook does)
            else:
                _completer.put(self)
        return self._future

    def is_completed(self) -> bool:
        """True once the collective is done (or failed) and its results are in the output
        tensors; never blocks."""
        if not self._done and all(h.done() for h in list(self._handles)):
            self._complete()  # (done: the results are copied now, not waited for)
        return self._done

    def is_success(self) -> bool:
        """Whether the collective succeeded; ``RuntimeError`` before it completed."""
        if not self._done:
            raise RuntimeError("Work.is_success() before the collective completed")
        return self._error is None

    def exception(self):
        """The collective's error, or None."""
        return self._error

    def result(self) -> list:
        """Wait, then the output tensors (a list)."""
        self.wait()
        return self._outputs

    def source_rank(self) -> int:
        """``RuntimeError``: only a ``recv`` from any source has one, and this backend has no ``recv``."""
        raise RuntimeError("source_rank() is for recv from any source, which sdp's backend does not have")


# ---------------------------------------------------------------- the process group

class ProcessGroupSDP(dist.ProcessGroup):
    """``torch.distributed.ProcessGroup`` on sdp's engine (see the module docstring).

    ``global_ranks``: the job ranks of this group in group-rank order (the whole job for the
    default group); ``process_set``: the sdp process set of those ranks (0: every rank).
    ``timeout``: seconds a ``Work.wait()`` may take (PyTorch's ``timeout=``)."""

    def __init__(self, rank: int, size: int, global_ranks: List[int], group_name: str,
                 timeout: Optional[float], process_set: int = 0):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._global = list(global_ranks)
        self._process_set = process_set
        self._timeout = timeout
        self._prefix = f"torch.{group_name or 'default'}."
        self._local = not api.has_wire()  # (every rank on this host: the fast lane exists)
        self._seq = itertools.count()
        self._seq_lock = threading.Lock()

    # -- subgroups
    @property
    def new_group(self):
        """PyTorch's hook for the subgroups of a Python default group: ``dist.new_group`` calls
        ``default_pg.new_group(ranks, ...)`` on every rank when the default group has one.  It
        is offered only where the new group's backend is this one (read from that caller's
        frame, which names neither backend nor ``use_local_synchronization`` to the hook), else
        PyTorch makes the group itself (Gloo beside sdp)."""
        caller = sys._getframe(1)
        f = caller.f_locals if caller.f_code.co_name == "_new_group_with_tag" else {}
        if str(f.get("backend", "")).lower() not in _NAMES or f.get("use_local_synchronization", True):
            raise AttributeError("new_group")
        return self._new_group

    def _new_group(self, ranks, timeout=None, pg_options=None, group_name=None, group_desc=None):
        """The group of job ``ranks`` (ascending), on every rank (see ``new_group``): an sdp
        process set registered on every rank (``sdp.api.add_process_sets``, once per set of
        ranks); the members' ``ProcessGroupSDP``, None elsewhere."""
        ranks = list(range(api.size())) if ranks is None else [int(r) for r in ranks]
        if ranks != sorted(ranks):
            raise NotImplementedError(f"torch.distributed backend 'sdp': a group of ranks {ranks} in another order "
                                      "than ascending (sort_ranks=False) is not supported")
        ps = 0 if ranks == list(range(api.size())) else _process_set(ranks)
        me = api.rank()
        if me not in ranks:
            return None
        return ProcessGroupSDP(ranks.index(me), len(ranks), ranks, str(group_name), _seconds(timeout), ps)

    # -- identity
    def getBackendName(self) -> str:
        """``"sdp"``."""
        return BACKEND

    def getRank(self) -> int:
        """This process's rank in the group."""
        return self._rank

    def getSize(self) -> int:
        """The number of ranks in the group."""
        return self._size

    def __repr__(self) -> str:
        return f"ProcessGroupSDP(rank={self._rank}, size={self._size})"

    # -- helpers
    def _name(self) -> str:
        with self._seq_lock:
            n = next(self._seq)
        return f"{self._prefix}{n % api.AUTO_NAMES}"

    def _now(self, t: torch.Tensor) -> bool:
        """Whether an asynchronous allreduce of ``t`` runs in the caller (see the module docstring)."""
        return self._local and not t.is_cuda and t.numel() * t.element_size() * (self._size - 1) <= NOW_BYTES

    def _work(self, handles, finish, outputs, tensors) -> Work:
        devices = [t.device for t in tensors if t.is_cuda] or None  # (a future of CUDA tensors names them)
        return Work(handles, finish, outputs, self._timeout, devices and sorted(set(devices), key=str))

    # -- collectives
    def _op(self, opts) -> ReduceOp:
        return _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)

    def _root(self, opts) -> int:
        """The job rank of ``opts.rootRank`` (a group rank)."""
        root = opts.rootRank if opts is not None else 0
        if not 0 <= root < self._size:
            raise ValueError(f"root rank {root} is outside the group's ranks [0, {self._size})")
        return self._global[root]

    def _flat(self, t: torch.Tensor, what: str):
        return _tensors.as_input(t.reshape(-1), what)

    def allreduce(self, tensors, opts=None):
        """``dist.all_reduce``: reduce each tensor in place over the group's ranks (``opts.reduceOp``)."""
        op = self._op(opts)
        if len(tensors) == 1 and (opts is not None and not opts.asyncOp or self._now(tensors[0])):
            t = tensors[0]  # (in this thread: see the module docstring)
            out = _tensors.out_array(t)
            result = api.allreduce(_tensors.as_input(t, "all_reduce") if out is None else out, self._name(), op,
                                   out=out, process_set=self._process_set)
            if out is None:
                _tensors.copy_into(t, result)
            return self._work([], _nothing, list(tensors), tensors)
        handles, outs = [], []
        for t in tensors:
            out = _tensors.out_array(t)  # (a CPU tensor is reduced in its own memory)
            outs.append(out)
            handles.append(api.allreduce_async(_tensors.as_input(t, "all_reduce") if out is None else out,
                                               self._name(), op, out=out, process_set=self._process_set))

        def finish(results):
            for t, out, r in zip(tensors, outs, results):
                if out is None:
                    _tensors.copy_into(t, r)
        return self._work(handles, finish, list(tensors), tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        """``all_reduce_coalesced``: ``allreduce`` of each tensor."""
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts=None):
        """``dist.broadcast``: each tensor overwritten with group rank ``opts.rootRank``'s."""
        root = self._root(opts)
        handles = [api.broadcast_async(_tensors.as_input(t, "broadcast"), root, self._name(), self._process_set)
                   for t in tensors]
        return self._work(handles, _into(tensors) if root != api.rank() else _nothing, list(tensors), tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        """``dist.all_gather``: ``output_tensors[i][j]`` becomes group rank ``j``'s ``input_tensors[i]``."""
        handles = [api.allgather_async(self._flat(t, "all_gather"), self._name(), self._process_set)
                   for t in input_tensors]
        return self._work(handles, lambda results: _split_into(output_tensors, results), list(output_tensors),
                          list(input_tensors))

    def all_gather_single(self, output, input, opts=None):
        """``dist.all_gather_into_tensor``: the group's inputs concatenated, in rank order, into ``output``."""
        return self.all_gather_single_coalesced([output], [input], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        """Each pair of ``all_gather_single``, in one ``Work``."""
        for o, i in zip(outputs, inputs):
            if o.numel() != i.numel() * self._size:
                raise ValueError(f"all_gather_into_tensor: an output of {o.numel()} elements for {self._size} "
                                 f"inputs of {i.numel()}; expected {i.numel() * self._size}")
        handles = [api.allgather_async(self._flat(t, "all_gather"), self._name(), self._process_set) for t in inputs]
        return self._work(handles, _into(outputs), list(outputs), list(inputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _reducescatter_rows(self, flat: torch.Tensor, op: ReduceOp):
        """Reduce-scatter ``flat`` seen as ``size`` equal rows: this rank gets its row."""
        return api.reducescatter_async(_tensors.as_input(flat.reshape(self._size, -1), "reduce_scatter"),
                                       self._name(), op, process_set=self._process_set)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """``dist.reduce_scatter``: rank ``r``'s output is the reduction of every rank's ``r``-th input."""
        op = self._op(opts)
        for o, ins in zip(output_tensors, input_tensors):
            if len(ins) != self._size or any(i.numel() != o.numel() for i in ins):
                raise ValueError(f"reduce_scatter: inputs of {[i.numel() for i in ins]} elements for {self._size} "
                                 f"ranks and an output of {o.numel()}; expected one input of {o.numel()} per rank")
        handles = [self._reducescatter_rows(torch.cat([i.reshape(-1) for i in ins]), op)
                   for ins in input_tensors]
        return self._work(handles, _into(output_tensors), list(output_tensors), list(output_tensors))

    def reduce_scatter_single(self, output, input, opts=None):
        """``dist.reduce_scatter_tensor``: the reduction of ``input``'s ``r``-th equal part into rank
        ``r``'s ``output``."""
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        """Each pair of ``reduce_scatter_single``, in one ``Work``."""
        op = self._op(opts)
        for o, i in zip(outputs, inputs):
            if i.numel() != o.numel() * self._size:
                raise ValueError(f"reduce_scatter_tensor: an input of {i.numel()} elements for {self._size} ranks "
                                 f"and an output of {o.numel()}; expected {o.numel() * self._size}")
        handles = [self._reducescatter_rows(i, op) for i in inputs]
        return self._work(handles, _into(outputs), list(outputs), list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce(self, tensors, opts=None):
        """``dist.reduce``: the reduction written into the root's tensors only."""
        root, op = self._root(opts), self._op(opts)
        handles = [api.allreduce_async(_tensors.as_input(t, "reduce"), self._name(), op,
                                       process_set=self._process_set) for t in tensors]
        return self._work(handles, _into(tensors) if root == api.rank() else _nothing, list(tensors), tensors)

    def gather(self, output_tensors, input_tensors, opts=None):
        """``dist.gather``: every rank's input into the root's output list."""
        root = self._root(opts)
        handles = [api.allgather_async(self._flat(t, "gather"), self._name(), self._process_set)
                   for t in input_tensors]
        finish = (lambda results: _split_into(output_tensors, results)) if root == api.rank() else _nothing
        return self._work(handles, finish, list(output_tensors), list(input_tensors))

    def scatter(self, output_tensors, input_tensors, opts=None):
        """``dist.scatter``: the root's ``r``-th input into rank ``r``'s output."""
        root = self._root(opts)
        handles = []
        for i, o in enumerate(output_tensors):
            if root == api.rank():
                parts = input_tensors[i]
                flat, splits = torch.cat([x.reshape(-1) for x in parts]), [x.numel() for x in parts]
            else:  # (an alltoall in which only the root sends)
                flat, splits = torch.empty(0, dtype=o.dtype, device=o.device), [0] * self._size
            handles.append(api.alltoall_async(_tensors.as_input(flat, "scatter"), splits, self._name(),
                                              self._process_set))
        return self._work(handles, _into(output_tensors, received=True), list(output_tensors),
                          list(output_tensors))

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """``dist.all_to_all``: ``input_tensors[j]`` to rank ``j``, rank ``j``'s into ``output_tensors[j]``."""
        flat = torch.cat([x.reshape(-1) for x in input_tensors])
        handle = api.alltoall_async(_tensors.as_input(flat, "all_to_all"), [x.numel() for x in input_tensors],
                                    self._name(), self._process_set)
        return self._work([handle], lambda results: _split_into([output_tensors], [results[0][0]]),
                          list(output_tensors), list(input_tensors))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """``dist.all_to_all_single``: rows of ``input`` by ``input_split_sizes`` (equal parts if
        empty) to each rank, theirs into ``output``."""
        splits = list(input_split_sizes) or None  # (None: equal parts of the first dimension)
        handle = api.alltoall_async(_tensors.as_input(input, "all_to_all_single"), splits, self._name(),
                                    self._process_set)
        return self._work([handle], lambda results: _tensors.copy_into(output, results[0][0]), [output], [input])

    alltoall_base = all_to_all_single

    def barrier(self, opts=None):
        """``dist.barrier``: done once every rank of the group reached it."""
        handle = api.allreduce_async(np.zeros(1, np.int32), self._name(), ReduceOp.SUM,
                                     process_set=self._process_set)
        return self._work([handle], _nothing, [], [])

    def _peer(self, rank: int, role: str) -> int:
        """The job rank of group rank ``rank`` (``send``'s ``dst``, ``recv``'s ``src``)."""
        if not 0 <= rank < self._size:
            raise ValueError(f"{role} rank {rank} is outside the group's ranks [0, {self._size})")
        return self._global[rank]

    def send(self, tensors, dst, tag=0):
        """``dist.send``/``isend``: each tensor to group rank ``dst`` (``sdp.api.send``: no other
        rank takes part; a CUDA tensor goes through host memory).  The ``Work`` completes once the
        tensors may be changed again."""
        peer = self._peer(dst, "send: dst")
        handles = [api.send(_tensors.as_input(t.detach().cpu() if t.is_cuda else t, "send"), peer, tag)
                   for t in tensors]
        return self._work(handles, _nothing, [], tensors)

    def recv(self, tensors, src, tag=0):
        """``dist.recv``/``irecv``: each tensor overwritten with what group rank ``src`` sent with
        ``tag`` (``sdp.api.recv``: into a CPU tensor's own memory, else through host memory); a
        message of another byte count raises ``TensorMismatchError`` from ``Work.wait()``."""
        peer = self._peer(src, "recv: src")
        outs = [_tensors.out_array(t) for t in tensors]
        outs = [o if o is not None else _tensors.as_input(torch.empty(t.shape, dtype=t.dtype), "recv")
                for t, o in zip(tensors, outs)]
        handles = [api.recv(o, peer, tag) for o in outs]
        return self._work(handles, _into(tensors), list(tensors), tensors)

    def recv_anysource(self, tensors, tag=0):
        """``NotImplementedError``: ``recv`` needs its source rank here."""
        raise NotImplementedError("torch.distributed backend 'sdp': recv from any source is not supported "
                                  "(give src)")


def _nothing(results) -> None:
    """The finish of a collective whose results are not this rank's to keep."""


def _into(tensors, received: bool = False):
    """The finish that copies each result (an alltoall's received part, with ``received``) into
    its tensor."""
    def finish(results):
        for t, r in zip(tensors, results):
            _tensors.copy_into(t, r[0] if received else r)
    return finish


def _split_into(output_lists, results) -> None:
    """Copy each flat result into its list of output tensors, in order."""
    for outs, r in zip(output_lists, results):
        off = 0
        for o in outs:
            _tensors.copy_into(o, r[off:off + o.numel()])
            off += o.numel()


# ---------------------------------------------------------------- creation and registration

def _seconds(timeout) -> Optional[float]:
    if isinstance(timeout, datetime.timedelta):
        s = timeout.total_seconds()
        return s if s > 0 else None
    return float(timeout) if timeout else None


_NAMES = set()  # the names the backend is registered under (register())
_sets = {}  # (runtime, job ranks) -> the sdp process set made for dist.new_group(ranks)


def _process_set(ranks: List[int]) -> int:
    """The sdp process set of ``ranks`` for a new group, registered on every rank the first time
    (every rank calls this: PyTorch's ``new_group`` rule)."""
    key = (id(api.runtime()), tuple(ranks))
    if key not in _sets:
        _sets[key] = api.add_process_sets([ranks])[0]
    return _sets[key]


def _tcp_store(store):
    """The ``TCPStore`` under ``store``'s prefixes, or None."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, dist.TCPStore) else None


def _init_beside(store) -> None:
    """``sdp.init()`` where PyTorch's ``TCPStore`` may hold ``MASTER_PORT`` already: sdp's rank 0
    serves its rendezvous at ``MASTER_ADDR:MASTER_PORT`` when nothing else names one (env:// with
    ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` from a launcher that is not sdprun, as
    Kubeflow's PyTorchJob sets them), so it takes ``MASTER_PORT + 1`` then, as under torchrun's
    agent store (``sdp.common.topology``)."""
    tcp = _tcp_store(store)
    env = os.environ
    beside = (tcp is not None and "SDP_RENDEZVOUS_ADDR" not in env and env.get("MASTER_PORT")
              and str(tcp.port) == env["MASTER_PORT"] and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True")
    if not beside:
        api.init()
        return
    before = env.get("TORCHELASTIC_USE_AGENT_STORE")
    env["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # (read by sdp's topology at init only; put back at once)
    try:
        api.init()
    finally:
        if before is None:
            del env["TORCHELASTIC_USE_AGENT_STORE"]
        else:
            env["TORCHELASTIC_USE_AGENT_STORE"] = before


def create_process_group(options, backend_options=None) -> ProcessGroupSDP:
    """The backend's creator (``register_backend``'s extended form): ``options`` is PyTorch's
    ``_DistributedBackendOptions`` (``store``, ``group_rank``, ``group_size``, ``timeout``,
    ``group_id``, ``global_ranks_in_group``).  Starts sdp (``sdp.init()``) if it is not running
    (``_init_beside``).
    Raises ``ValueError`` when PyTorch's rank or world size is not sdp's, ``NotImplementedError``
    for a group over a strict subset of the ranks made without the default group's hook
    (``new_group(..., use_local_synchronization=True)``, or next to a default group of another
    backend: only its members call the creator, and sdp registers process sets on every rank)."""
    if not api.is_initialized():
        _init_beside(options.store)
    rank, size = options.group_rank, options.group_size
    ranks = list(options.global_ranks_in_group) or list(range(api.size()))
    if not options.global_ranks_in_group and (rank, size) != (api.rank(), api.size()):
        raise ValueError(f"init_process_group(backend='sdp'): rank {rank} of world size {size} given, but sdp "
                         f"runs this process as rank {api.rank()} of {api.size()} (leave rank and world_size "
                         "out, or give sdp's)")
    if sorted(ranks) != list(range(api.size())):
        raise NotImplementedError(
            f"torch.distributed backend 'sdp': a group of ranks {ranks} (a strict subset of the job's "
            f"{api.size()}) is made on its members only here (use_local_synchronization=True, or a default "
            "group of another backend), and sdp registers process sets on every rank: make the default "
            "group sdp's and call dist.new_group(ranks) on every rank, or use sdp.torch's process sets")
    return ProcessGroupSDP(rank, size, ranks, str(options.group_id), _seconds(options.timeout))


class LocalStore(dist.Store):
    """The store of a default group made without ``MASTER_ADDR`` (see the module docstring):
    this process's keys only, nothing listening.  sdp's backend needs no store; a backend that
    does (a Gloo group beside it across processes) gets ``RuntimeError`` at once when it reads a
    key another process would have set, instead of waiting for it until its timeout."""

    def __init__(self):
        super().__init__()
        self._data = {}
        self._lock = threading.Lock()

    def _missing(self, key) -> RuntimeError:
        return RuntimeError(f"key {key!r} is not in this process's store: torch.distributed was initialized from "
                            "sdp's environment without MASTER_ADDR, so no store is shared between the ranks (sdp's "
                            "backend needs none); set MASTER_ADDR and MASTER_PORT (sdprun -x) for a Gloo or NCCL group")

    def set(self, key, value) -> None:
        """Store ``value`` (bytes or str) under ``key``."""
        with self._lock:
            self._data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key) -> bytes:
        """The value of ``key``; ``RuntimeError`` where no one here set it (see the class)."""
        with self._lock:
            if key not in self._data:
                raise self._missing(key)
            return self._data[key]

    def add(self, key, value: int) -> int:
        """Add ``value`` to the integer under ``key`` (0 if unset); return the sum."""
        with self._lock:
            n = int(self._data.get(key, b"0")) + int(value)
            self._data[key] = str(n).encode()
            return n

    def compare_set(self, key, expected, desired) -> bytes:
        """Set ``key`` to ``desired`` if its value is ``expected``; return its value."""
        with self._lock:
            expected = expected.encode() if isinstance(expected, str) else bytes(expected)
            if self._data.get(key, b"") == expected:
                self._data[key] = desired.encode() if isinstance(desired, str) else bytes(desired)
            return self._data.get(key, expected)

    def wait(self, keys, timeout=None) -> None:
        """Return if every key is set here, else ``RuntimeError`` (see the class)."""
        with self._lock:
            missing = [k for k in keys if k not in self._data]
        if missing:
            raise self._missing(missing[0])

    def check(self, keys) -> bool:
        """Whether every key is set here."""
        with self._lock:
            return all(k in self._data for k in keys)

    def delete_key(self, key) -> bool:
        """Remove ``key``; whether it was there."""
        with self._lock:
            return self._data.pop(key, None) is not None

    def num_keys(self) -> int:
        """The number of keys set here."""
        with self._lock:
            return len(self._data)


def _sdp_rendezvous(url: str, rank: int = -1, world_size: int = -1, **kwargs):
    """``init_method`` ``sdp://`` (and ``env://`` without ``MASTER_ADDR``): rank and world size
    from sdp's environment unless given, and a ``LocalStore``."""
    from sdp.common import topology
    topo = topology.from_env()
    rank = topo.rank if rank is None or rank < 0 else rank
    world_size = topo.size if world_size is None or world_size < 0 else world_size
    yield LocalStore(), rank, world_size


def _rendezvous_module():
    import importlib
    return importlib.import_module("torch.distributed.rendezvous")  # (the package re-exports a function of that name)


def _wrap_env_handler():
    handlers = _rendezvous_module()._rendezvous_handlers
    original = handlers.get("env")
    if original is None or getattr(original, "__sdp__", False):
        return

    def env_or_sdp(url: str, **kwargs):
        if "MASTER_ADDR" not in os.environ:
            return _sdp_rendezvous(url, **kwargs)
        return original(url, **kwargs)

    env_or_sdp.__sdp__ = True
    env_or_sdp.__wrapped__ = original
    handlers["env"] = env_or_sdp


def register(name: str = BACKEND) -> None:
    """Register sdp's backend under ``name`` (``"sdp"``; ``sdp.compat_smddp.torch.torch_smddp`` adds
    ``"smddp"``) and the ``sdp://`` init method with ``torch.distributed`` (idempotent; ``"sdp"``
    is registered when this module is imported)."""
    _NAMES.add(name.lower())
    if name.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(name, create_process_group, extended_api=True, devices=["cpu", "cuda"])
    rdzv = _rendezvous_module()
    if SCHEME not in rdzv._rendezvous_handlers:
        rdzv.register_rendezvous_handler(SCHEME, _sdp_rendezvous)
    _wrap_env_handler()


register()

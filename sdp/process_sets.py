"""Horovod's process sets, framework-free: ``ProcessSet``, ``global_process_set``,
``add_process_set``, ``remove_process_set``.  Mirrors ``horovod.common.process_sets``; the
TensorFlow face (``sdp.tensorflow``, ``horovod.tensorflow`` under ``--compat horovod``)
exports these objects and takes them as ``process_set=`` on every collective.

- ``ProcessSet(ranks)``: a set of job ranks (sorted; ``ValueError`` unless all are ints; an MPI
  communicator raises ``NotImplementedError``: sdp has no MPI).  It gets its ``process_set_id``
  when registered: statically with ``init(process_sets=[...])`` (every rank passes the same
  list), or dynamically with ``add_process_set`` (only when ``HOROVOD_DYNAMIC_PROCESS_SETS=1``
  or ``init(process_sets="dynamic")``, else ``ValueError``, as in Horovod; every rank adds the
  same sets in the same order).  ``size()`` (ranks in the set), ``rank()`` (this rank's index in
  the set; ``ValueError`` if it is not in it), ``included()`` return None while unregistered.
- Collectives on a set are called by its ranks only; another rank gets ``ValueError`` naming
  the set and the rank.  Broadcast roots are job ranks (``hvd.rank()``), as in Horovod.
- ``global_process_set``: id 0, every rank (``ranks`` is ``[]`` before ``init()``).

How the engine negotiates and runs sets: ``sdp.engine.process_sets``.
"""
import os
from typing import List, Optional, Sequence, Union

from sdp import api

DYNAMIC_ENV = "HOROVOD_DYNAMIC_PROCESS_SETS"


class ProcessSet:
    """A set of job ranks that run collectives together.  Mirrors ``horovod.common.process_sets.ProcessSet``."""

    process_set_id = None
    ranks = None
    mpi_comm = None

    def __init__(self, ranks_or_comm: Sequence[int]):
        if isinstance(ranks_or_comm, (str, bytes)) or not hasattr(ranks_or_comm, "__iter__"):
            raise NotImplementedError("ProcessSet from an MPI communicator: sdp does not use MPI; "
                                      "give the list of ranks")
        ranks = list(ranks_or_comm)
        if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
            raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py Comm object")
        self.ranks = sorted(ranks)

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> Optional[int]:
        """Number of ranks in the set; None while unregistered."""
        if self.process_set_id is None:
            return None
        ranks = api.process_set_ranks(self.process_set_id)
        if ranks is None:
            raise ValueError("Process set does not exist or has not been registered.")
        return len(ranks)

    def rank(self) -> Optional[int]:
        """This process's rank within the set (its index in ``ranks``); None while unregistered;
        ``ValueError`` if this process is not in the set.  Collectives still take job ranks."""
        if self.process_set_id is None:
            return None
        ranks = api.process_set_ranks(self.process_set_id)
        if ranks is None:
            raise ValueError("Process set does not exist or has not been registered.")
        me = api.rank()
        if me not in ranks:
            raise ValueError(f"Process is not part of provided process set: rank {me} is not in {self}.")
        return ranks.index(me)

    def included(self) -> Optional[bool]:
        """Whether this process is in the set; None without ranks."""
        if self.ranks is None:
            return None
        return api.rank() in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


class _GlobalProcessSet(ProcessSet):
    """Every rank of the job, id 0."""

    process_set_id = 0

    def __init__(self):
        pass

    @property
    def ranks(self):
        return list(range(api.size())) if api.is_initialized() else []

    def size(self) -> int:
        return api.size()

    def rank(self) -> int:
        return api.rank()

    def included(self) -> bool:
        return True

    def _invalidate(self) -> None:  # the global set stays
        pass


global_process_set = _GlobalProcessSet()
"""The process set of every rank (id 0), the default ``process_set`` of every collective.
Mirrors ``horovod.tensorflow.global_process_set``."""


def _dynamic() -> bool:
    return os.environ.get(DYNAMIC_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def init_process_sets(process_sets) -> None:
    """Register the static sets of ``init(process_sets=...)``: a list of ``ProcessSet``
    (every rank passes the same list; ``ValueError`` for a duplicate, naming its place), or
    ``"dynamic"`` (sets ``HOROVOD_DYNAMIC_PROCESS_SETS=1``), or None."""
    if process_sets is None:
        return
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError(f"process_sets must be a list of ProcessSet or 'dynamic', got {process_sets!r}")
        os.environ[DYNAMIC_ENV] = "1"
        return
    sets = list(process_sets)
    for i, ps in enumerate(sets):
        if not isinstance(ps, ProcessSet) or ps.ranks is None:
            raise ValueError(f"process_sets entry number {i} is not a ProcessSet with ranks: {ps!r}")
        if any(ps.ranks == other.ranks for other in sets[:i]):
            raise ValueError(f"Horovod could not be initialized because process_sets entry number {i} is a "
                             f"duplicate: {ps}")
    if sets:
        for ps, ps_id in zip(sets, api.add_process_sets([ps.ranks for ps in sets])):
            ps.process_set_id = ps_id


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a new process set after ``init()`` and return it (a ``ProcessSet``; a list of
    ranks makes one).  Every rank calls it with the same set, in the same order.  Raises
    ``ValueError`` unless ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` (Horovod's message), for a set that
    exists already, or for invalid ranks.  Mirrors ``horovod.tensorflow.add_process_set``."""
    if not api.is_initialized():
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if not _dynamic():
        raise ValueError("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow adding process sets after Horovod "
                         "initialization.")
    process_set.process_set_id = api.add_process_sets([process_set.ranks])[0]
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` on every rank (a collective over all ranks) and invalidate the
    object; False for the global set or an unregistered one.  Raises ``ValueError`` unless
    ``HOROVOD_DYNAMIC_PROCESS_SETS=1``.  Mirrors ``horovod.tensorflow.remove_process_set``."""
    if not api.is_initialized():
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    if not _dynamic():
        raise ValueError("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow removing process sets after Horovod "
                         "initialization.")
    if process_set.process_set_id == 0:
        return False
    removed = api.remove_process_set(process_set)
    process_set._invalidate()
    return removed


def process_set_id(process_set) -> int:
    """The engine id of ``process_set`` (``ValueError`` for an unregistered or removed set)."""
    return api.process_set_id(process_set)


def set_size(process_set) -> int:
    """Number of ranks of ``process_set`` (the job's size for the global set)."""
    ranks = api.process_set_ranks(process_set)
    if ranks is None:
        raise ValueError(f"{process_set}: process set does not exist or has not been registered")
    return len(ranks)


__all__: List[str] = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]

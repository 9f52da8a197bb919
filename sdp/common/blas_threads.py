"""numpy's BLAS threads when several ranks share a host's cores.

numpy's BLAS (OpenBLAS, bundled with numpy's wheels) starts one thread per core in every
process, and its idle threads poll for work for a while before they sleep.  With several ranks
on a host, each rank's BLAS threads then take the cores the other ranks need: for their own
products, and for the engine thread and the caller that runs a collective.  Measured on a
2-core machine, 2 ranks, 1 ms of ``np.dot`` (300 x 300 float32) then a 1 KB allreduce
(``benchmarks/blas_threads.py``, 6 rounds alternating in one job): capped at one thread each,
the allreduce took 45.9 us and one product 531 us; with BLAS's default of a thread per core,
600 us and 11.6 ms (a second run: 46.5 us / 531 us against 663 us / 3.1 ms).

``share_cores`` therefore caps the BLAS libraries loaded at ``init()`` at this rank's share
of the cores (``cores // local_size``, at least 1) through threadpoolctl, as torchrun sets
``OMP_NUM_THREADS=1`` for several processes per node.  A thread count the user chose wins:
nothing changes when ``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``,
``BLIS_NUM_THREADS`` or ``GOTO_NUM_THREADS`` is set, or with one rank on the host.  Libraries
loaded after ``init()`` (a SciPy of its own BLAS) keep their defaults.
"""
import logging
import os
from typing import Optional

log = logging.getLogger("sdp")

#: variables by which a user (or a launcher) chose BLAS's thread count: then it is left alone
USER_SET = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS", "GOTO_NUM_THREADS")


def share_cores(local_size: int) -> Optional[int]:
    """Cap the BLAS thread pools loaded in this process at ``cores // local_size`` threads (at
    least 1) when ``local_size`` (ranks on this host) > 1 and no variable of ``USER_SET`` is
    set; returns the cap, or None when nothing was changed (also without threadpoolctl)."""
    if local_size <= 1 or any(os.environ.get(v) for v in USER_SET):
        return None
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - a dependency; a broken install keeps BLAS's defaults
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    cap = max(1, cores // local_size)
    threadpool_limits(limits=cap, user_api="blas")
    log.debug("BLAS thread pools capped at %d threads (%d ranks on this host, %d cores)", cap, local_size, cores)
    return cap

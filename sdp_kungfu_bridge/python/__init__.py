"""Cluster management on sdp: mirrors ``kungfu.python``.

Like KungFu, importing this module joins the cluster (``init()``: reads the ``SDP_*`` topology that
``sdprun`` sets, or runs as a world of size 1) and leaving happens at exit.  Set
``KUNGFU_DISABLE_AUTO_LOAD=1`` (KungFu's switch) or ``SDP_KUNGFU_NO_AUTO_INIT=1`` to join later
with an explicit ``init``.  ``init()`` is idempotent and adopts an engine started with
``sdp.init()``; ``finalize`` leaves (``sdp.shutdown()``).

Elastic training (``sdprun -w``): ``resize`` and ``propose_new_size``; the protocol is
described in ``sdp_kungfu_bridge._cluster``.  After a worker is detached, ``detached``
is true, the ``current_*`` functions keep answering with the values of the cluster it left, and
collectives raise ``DetachedError`` (or ``NotInitializedError`` from ``sdp.api``): the worker
should exit.
"""
from sdp_kungfu_bridge import _cluster
from sdp_kungfu_bridge._cluster import DetachedError, ElasticError, ResizeError  # noqa: F401

__all__ = [
    'current_cluster_size',
    'current_local_rank',
    'current_local_size',
    'current_rank',
    'detached',
    'run_barrier',
]


def init():
    """Join the cluster (idempotent).  Called on import unless auto-init is disabled."""
    _cluster.init()


def finalize():
    """Leave the cluster and stop the engine (idempotent; also runs at exit)."""
    _cluster.finalize()


def uid():
    """Get the uid of this peer (a 63-bit integer, unique per process)."""
    return _cluster.uid()


def detached():
    """Check if the peer is detached (a ``resize`` removed it from the cluster)."""
    return _cluster.detached()


def current_rank():
    """Get the current rank of this peer."""
    return _cluster.rank()


def current_local_rank():
    """Get the current local rank of this peer."""
    return _cluster.local_rank()


def current_cluster_size():
    """Get the number of peers in the current cluster."""
    return _cluster.size()


def current_local_size():
    """Get the number of local peers in the current cluster."""
    return _cluster.local_size()


def run_barrier():
    """Run the barrier operation eagerly: return once every peer has called it."""
    _cluster.barrier()


def propose_new_size(new_size):
    """Ask for a cluster of ``new_size`` peers: writes it to the config server.  Nothing changes
    until the peers call ``resize`` without a size.  Raises ``ElasticError`` when there is no
    config server (launch with ``sdprun -w``)."""
    _cluster.propose_new_size(new_size)


def resize(n=None):
    """Resize the cluster to ``n`` peers, or to the config server's size if ``n`` is None.

    Every peer must call it at the same point.  Returns ``(changed, detached)``: whether the
    cluster changed, and whether this peer was removed from it (it should then exit).  New peers
    are started by ``sdprun -w``; after a change, broadcast the model and step from rank 0."""
    return _cluster.resize(n)


def all_reduce_int_max(x):
    """The maximum of the integer ``x`` over all peers."""
    return _cluster.all_reduce_int_max(x)


def _get_other_ranks():
    return _cluster.other_ranks()


def _get_cuda_index():
    return current_local_rank()


def show_cuda_version():
    """Print that NCCL is not enabled (sdp reduces on the host).  Mirrors KungFu's function."""
    print('NCCL is NOT enabled (sdp reduces on the host)')


def show_nccl_version():
    """Print that NCCL is not enabled (sdp reduces on the host).  Mirrors KungFu's function."""
    print('NCCL is NOT enabled (sdp reduces on the host)')


if _cluster.auto_init_enabled():
    init()

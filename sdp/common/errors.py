"""Exceptions raised by sdp.

Every error a user can see derives from :class:`SdpError`, so ``except sdp.errors.SdpError``
catches all of them.  The names mirror what Horovod users know (``HorovodInternalError`` is
``SdpError``'s role) while staying specific enough to act on.
"""


class SdpError(RuntimeError):
    """Base class of every sdp error."""


class NotInitializedError(SdpError, ValueError):
    """An sdp function was called before ``init()`` (or after ``shutdown()``).

    Subclasses ``ValueError`` because Horovod raises ``ValueError`` in the same situation.
    """

    def __init__(self, what: str = "this function"):
        super().__init__(
            f"sdp has not been initialized; call sdp.init() (or hvd.init()) before {what}."
        )


class AlreadyInitializedError(SdpError):
    """``init()`` was called a second time (SMDDP documents this as an error)."""

    def __init__(self):
        super().__init__(
            "init() called more than once. smdistributed.dataparallel is already initialized."
        )


class TopologyError(SdpError, ValueError):
    """The environment describes an impossible topology (e.g. rank >= size)."""


class RendezvousError(SdpError):
    """The processes could not find each other (timeout, duplicate rank, size mismatch)."""


class PeerLostError(SdpError):
    """A peer process died or disconnected; carries the lost rank in ``.rank``."""

    def __init__(self, rank: int, detail: str = ""):
        self.rank = rank
        msg = f"lost connection to rank {rank}"
        super().__init__(msg + (f": {detail}" if detail else ""))


class TensorMismatchError(SdpError, ValueError):
    """Ranks submitted the same tensor name with different shape/dtype/op/root/scale.

    The message names the tensor, the attribute, and each differing rank's value, e.g.
    ``allreduce of 'grad_3': shape mismatch, rank 0 has [2, 3], rank 1 has [3, 3]``.
    """


class StallError(SdpError):
    """Some ranks submitted a tensor and others did not for longer than
    ``SDP_STALL_SHUTDOWN_TIME`` seconds."""


class CollectiveTimeoutError(SdpError, TimeoutError):
    """A blocking wait in a collective exceeded its deadline (``SDP_TIMEOUT`` seconds)."""


class ProtocolError(SdpError):
    """A peer sent a message that does not fit the protocol (wrong tag, size or kind)."""

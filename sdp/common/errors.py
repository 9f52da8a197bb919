"""Exceptions raised by sdp.

Every error a user can see derives from ``SdpError``, so ``except sdp.errors.SdpError``
catches all of them.  The names mirror what Horovod users know (``HorovodInternalError`` is
``SdpError``'s role) while staying specific enough to act on.

``sdp_message`` finds sdp's message in an exception that ends a rank, also where TensorFlow
re-raised it under its own class and text (a graph collective's status): a rank started by
``sdprun`` prints that one line instead of the traceback (``sdp.common.rank_signals``).
"""
import collections
from typing import Optional, Tuple

_RECENT = collections.deque(maxlen=32)  # the messages of the last sdp errors made in this process


class SdpError(RuntimeError):
    """Base class of every sdp error."""

    def __init__(self, *args):
        super().__init__(*args)
        if args and isinstance(args[0], str) and len(args[0]) >= 16:
            _RECENT.append(args[0])


def sdp_message(exc: BaseException) -> Optional[Tuple[str, str]]:
    """``(class name, message)`` of the sdp error that ``exc`` is or was raised from (its
    ``__cause__`` / ``__context__`` chain), or of ``exc`` when its text holds the message of an sdp
    error made in this process (TensorFlow's error for a graph collective's status); else None."""
    seen, e = set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, SdpError):
            return type(e).__name__, str(e)
        e = e.__cause__ or e.__context__
    text = str(exc)
    for message in reversed(_RECENT):
        if message in text:
            return type(exc).__name__, message
    return None


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


# ---- Horovod's names (``horovod.common.exceptions`` is this module under ``--compat horovod``)

HorovodInternalError = SdpError
"""``horovod.common.exceptions.HorovodInternalError`` ("a collective operation failed"): every
sdp error derives from ``SdpError``, so ``except HorovodInternalError`` catches a lost peer,
a stall, a timeout or a mismatch."""


class HostsUpdatedInterrupt(SdpError):
    """The set of hosts of an elastic job changed.  Mirrors
    ``horovod.common.exceptions.HostsUpdatedInterrupt`` (``skip_sync``: reset without restoring the
    committed state).  Raised on every rank at the same ``State.commit()`` /
    ``check_host_updates()`` when ``sdprun --host-discovery-script`` found new slots
    (``sdp.elastic``); ``hvd.elastic.run`` catches it before ``HorovodInternalError``."""

    def __init__(self, skip_sync: bool = False):
        super().__init__(f"the hosts of the job changed (skip_sync={skip_sync})")
        self.skip_sync = skip_sync


def get_version_mismatch_message(name: str, version: str, installed_version: str) -> str:
    """The message of ``HorovodVersionMismatchError``.  Mirrors Horovod's function."""
    return (f"Framework {name} installed with version {installed_version} but found version {version}. "
            "This can result in unexpected behavior including runtime errors.")


class HorovodVersionMismatchError(ImportError):
    """A framework's version differs from the one a binary was built with.  Mirrors
    ``horovod.common.exceptions.HorovodVersionMismatchError``; sdp has no such binary and does not
    raise it."""

    def __init__(self, name: str, version: str, installed_version: str):
        super().__init__(get_version_mismatch_message(name, version, installed_version))
        self.name = name
        self.version = version
        self.installed_version = installed_version

"""Signals in a rank started by ``sdprun``: quiet stops and stack dumps on request.

Installed by ``import sdp`` when ``SDP_JOB_ID`` is set (``sdprun`` sets it for every rank) and
``import sdp`` runs in the main thread; a script run without ``sdprun`` keeps Python's defaults.

Quiet stops
    SIGINT (Ctrl-C, forwarded by ``sdprun``) and SIGTERM raise ``KeyboardInterrupt`` in the main
    thread, so ``finally`` blocks and ``atexit`` handlers (``sdp.shutdown``) run.  If that
    interruption -- or any exception while a stop signal was received, e.g. the ``PeerLostError``
    of a rank whose peer stopped first -- ends the script, the rank prints one line instead of a
    traceback: ``rank 1: interrupted at step 57 (SIGINT)``.  The step is the value of an ``int``
    variable named ``step`` in the outermost frame of the traceback that has one (the training
    loop of the examples); it is left out when there is none.  The process then ends by the
    signal it got (exit status 130 for SIGINT, 143 for SIGTERM).

Stacks on request
    ``STACK_SIGNAL`` (SIGUSR1) makes the rank write every thread's Python stack to standard error
    (:func:`faulthandler.register`).  ``sdprun`` sends it to the ranks its stall check names (see
    :mod:`sdp.launcher.procs`); ``kill -USR1 PID`` works too.
"""
import atexit
import faulthandler
import os
import signal
import sys
import threading
import types
from typing import Optional

#: the signal on which a rank prints its Python stacks
STACK_SIGNAL = signal.SIGUSR1
JOB_ENV = "SDP_JOB_ID"

_received: Optional[int] = None  # the stop signal this process got, if any
_installed = False


def _on_stop(signum, frame):
    global _received
    first = _received is None
    _received = signum
    if first:
        raise KeyboardInterrupt


def step_of(tb: Optional[types.TracebackType]) -> Optional[int]:
    """The ``int`` local ``step`` of the outermost frame of ``tb`` that has one, else None."""
    while tb is not None:
        value = tb.tb_frame.f_locals.get("step")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        tb = tb.tb_next
    return None


def interrupted_line(rank: str, signum: int, step: Optional[int]) -> str:
    """The one line a rank prints when a stop signal ends it."""
    where = f" at step {step}" if step is not None else ""
    return f"rank {rank}: interrupted{where} ({signal.Signals(signum).name})"


def _excepthook(previous):
    def hook(exc_type, exc, tb):
        global _received
        if _received is None and issubclass(exc_type, KeyboardInterrupt):
            _received = signal.SIGINT  # raised by Python's own handler (a handler set before ours)
        if _received is None:
            return previous(exc_type, exc, tb)
        rank = os.environ.get("SDP_RANK", os.environ.get("SDP_HOSTNAME", "?"))
        try:
            print(interrupted_line(rank, _received, step_of(tb)), file=sys.stderr, flush=True)
        except Exception:  # pragma: no cover - stderr closed
            pass
    return hook


def _end_by_signal():
    """At exit (after the other atexit handlers): end by the stop signal received, as an
    uncaught signal would (Python itself does so for SIGINT)."""
    if _received is not None and _received != signal.SIGINT:
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(_received, signal.SIG_DFL)
        os.kill(os.getpid(), _received)


def install() -> bool:
    """Install the handlers described above (idempotent); False outside the main thread."""
    global _installed
    if _installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True)
    for s in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(s) in (signal.default_int_handler, signal.SIG_DFL):
            signal.signal(s, _on_stop)
    sys.excepthook = _excepthook(sys.excepthook)
    atexit.register(_end_by_signal)  # registered early: runs after sdp's own shutdown
    _installed = True
    return True


def install_from_env(environ=os.environ) -> bool:
    """:func:`install` when this process is a rank started by ``sdprun`` (``SDP_JOB_ID`` set)."""
    return install() if environ.get(JOB_ENV) else False

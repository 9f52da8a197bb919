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
    loop of the examples); it is left out when there is none.  From the moment the signal
    arrives, the rank's standard error (file descriptor 2) goes to ``/dev/null`` -- a watcher
    thread sees the signal at once through ``signal.set_wakeup_fd``, even while the main
    thread waits inside TensorFlow -- so the errors of collectives that the stop cuts short
    (TensorFlow logs them from C++) do not fill the terminal; standard output is kept, and the
    one line goes to the original standard error.  The process then runs its
    ``atexit`` handlers and ends by the signal it got (exit status 130 for SIGINT, 143 for
    SIGTERM) without the rest of the interpreter's finalization: TensorFlow's teardown took
    longer than ``sdprun``'s 3 s grace period on a loaded 2-core machine, so the ranks were
    killed.  A script that catches the interruption itself ends as it chooses.  A stop signal
    that comes after the script ended with an exception (its ``atexit`` handlers, sdp's shutdown
    among them, running: ``sdprun`` stops the other ranks when one fails) is noted, not raised.

sdp's errors in one line
    An sdp error that ends the script (``sdp.common.errors.sdp_message``: a
    ``TensorMismatchError``, ``StallError``, ``PeerLostError``, ..., also as TensorFlow re-raised
    it from a graph) is printed as one line instead of its traceback, where sdp's frames and
    TensorFlow's hid the script's: ``rank 1: TensorMismatchError: allreduce of 'grad': shape
    mismatch, rank 0 has [4], rank 1 has [5] (train.py, line 12; SDP_LOG_LEVEL=debug prints the
    traceback)``, naming the script's innermost frame.  With ``SDP_LOG_LEVEL=debug``, and for
    every other exception, Python's traceback as usual.

Stacks on request
    ``STACK_SIGNAL`` (SIGUSR1) makes the rank write every thread's Python stack to standard error,
    the script's (main) thread first, outermost call first, then sdp's and other threads, each
    under its name: the watcher thread above writes them when it reads the signal, so a main
    thread waiting inside TensorFlow or sdp is shown too.  (Where another wakeup fd was set
    already, ``faulthandler.register`` writes them, in the interpreter's order.)  ``sdprun``
    sends it to the ranks its stall check names (see ``sdp.launcher.procs``); ``kill -USR1 PID``
    works too.

Stacks at a crash
    A rank that dies of a fatal signal (SIGSEGV, SIGFPE, SIGABRT -- glibc's ``free(): ...``
    aborts --, SIGBUS, SIGILL) writes every thread's Python stack first
    (``faulthandler.enable``), to the original standard error: a crash after a stop signal
    silenced fd 2 is still seen, with the thread it happened in.  Not where the script or
    ``PYTHONFAULTHANDLER`` enabled faulthandler already.
"""
import atexit
import faulthandler
import os
import signal
import sys
import threading
import traceback
import types
from typing import Optional

#: the signal on which a rank prints its Python stacks
STACK_SIGNAL = signal.SIGUSR1
JOB_ENV = "SDP_JOB_ID"

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: Optional[int] = None  # the stop signal this process got, if any
_raised = False  # KeyboardInterrupt raised for it
_stderr_fd: Optional[int] = None  # the original standard error, once fd 2 is silenced
_fault_fd: Optional[int] = None  # a copy of the original standard error for crash stacks
_installed = False
_ended = False  # the script ended with an exception (the excepthook ran): exiting already
_stderr_lock = threading.Lock()  # _stderr_fd and fd 2 change together (see _silence_stderr)


def _on_stop(signum, frame):
    global _received, _raised
    if _received is None:
        _received = signum
    if not _raised and not _ended:  # (a script that ended already is in its atexit handlers: sdp's
        _raised = True  # shutdown; interrupting it printed "Exception ignored in atexit callback")
        raise KeyboardInterrupt


def _silence_stderr() -> None:
    """Point fd 2 at /dev/null, keeping the original in ``_stderr_fd`` (once).  Under
    ``_stderr_lock``, which the one-line writer takes too: a line written while this runs (the
    main thread gets the GIL back at each system call here) goes to the original, never to
    /dev/null."""
    global _stderr_fd
    with _stderr_lock:
        if _stderr_fd is not None:
            return
        _stderr_fd = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 2)
        finally:
            os.close(devnull)


def _watch(read_fd: int) -> None:
    """The wakeup fd's reader: the first stop signal silences standard error at once."""
    global _received
    while True:
        try:
            data = os.read(read_fd, 64)
        except InterruptedError:  # pragma: no cover
            continue
        except OSError:  # pragma: no cover - closed
            return
        if not data:
            return
        if STACK_SIGNAL in data:
            _write_stacks()
        stops = [b for b in data if b in _STOP_SIGNALS]
        if stops:
            if _received is None:
                _received = stops[0]
            _silence_stderr()


def stacks_text() -> str:
    """Every thread's Python stack but the caller's: the main thread's first (outermost call
    first, as in a traceback), then the others, each under a line naming it."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    me = threading.get_ident()
    order = [main] + sorted(i for i in frames if i not in (main, me))
    parts = []
    for ident in order:
        frame = frames.get(ident)
        if frame is None:
            continue
        what = "the script's main thread" if ident == main else f"thread {names.get(ident, hex(ident))!r}"
        parts.append(f"Python stack of {what} (most recent call last):\n" + "".join(traceback.format_stack(frame)))
    return "".join(parts)


def _write_stacks() -> None:
    try:
        os.write(_stderr_fd if _stderr_fd is not None else 2, stacks_text().encode("utf-8", "replace"))
    except Exception:  # pragma: no cover - stderr closed
        pass


def _no_op(signum, frame):
    """The Python handler of STACK_SIGNAL: the watcher thread does the work (see _watch)."""


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


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LIBRARY_DIRS = tuple(os.path.join(_ROOT, d) + os.sep for d in ("sdp", "sdp_kungfu_bridge"))


def _script_frame(tb: Optional[types.TracebackType]) -> Optional[str]:
    """``file, line N`` of the innermost frame of ``tb`` outside sdp and installed packages."""
    where = None
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not (name.startswith(_LIBRARY_DIRS) or "-packages" + os.sep in name or name.startswith("<frozen")):
            where = f"{name}, line {tb.tb_lineno}"
        tb = tb.tb_next
    return where


def error_line(rank: str, exc: BaseException, tb: Optional[types.TracebackType]) -> Optional[str]:
    """The one line that stands for ``exc`` ending a rank (see the module docstring), or None:
    not an sdp error, or ``SDP_LOG_LEVEL=debug``."""
    from sdp.common.errors import sdp_message
    if os.environ.get("SDP_LOG_LEVEL", "").strip().lower() in ("debug", "10"):
        return None
    got = sdp_message(exc)
    if got is None:
        return None
    kind, message = got
    where = _script_frame(tb)
    how = f"{where}; " if where else ""
    return f"rank {rank}: {kind}: {' '.join(message.split())} ({how}SDP_LOG_LEVEL=debug prints the traceback)"


def _excepthook(previous):
    def hook(exc_type, exc, tb):
        global _received, _ended
        _ended = True
        if _received is None and issubclass(exc_type, KeyboardInterrupt):
            _received = signal.SIGINT  # raised by Python's own handler (a handler set before ours)
        if _received is None:
            line = error_line(os.environ.get("SDP_RANK", "?"), exc, tb)
            if line is None:
                return previous(exc_type, exc, tb)
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
            return
        rank = os.environ.get("SDP_RANK", os.environ.get("SDP_HOSTNAME", "?"))
        line = interrupted_line(rank, _received, step_of(tb)) + "\n"
        try:
            sys.stderr.flush()
            with _stderr_lock:
                os.write(_stderr_fd if _stderr_fd is not None else 2, line.encode())
        except Exception:  # pragma: no cover - stderr closed
            pass
        _die_by(_received)
    return hook


def _die_by(signum: int) -> None:
    """Run the ``atexit`` handlers (sdp's shutdown among them), flush, and end by ``signum``."""
    try:
        atexit._run_exitfuncs()
    except BaseException:  # pragma: no cover - a handler failed: end anyway
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # pragma: no cover
            pass
    signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # pragma: no cover - only if the signal did not end the process


def install() -> bool:
    """Install the handlers described above (idempotent); False outside the main thread."""
    global _installed
    if _installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    _enable_crash_stacks()
    for s in _STOP_SIGNALS:
        if signal.getsignal(s) in (signal.default_int_handler, signal.SIG_DFL):
            signal.signal(s, _on_stop)
    read_fd, write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    os.set_blocking(read_fd, True)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    if previous != -1:  # someone else's (an event loop): keep it, and stderr as it is
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True)
    else:
        threading.Thread(target=_watch, args=(read_fd,), name="sdp-stop-watch", daemon=True).start()
        signal.signal(STACK_SIGNAL, _no_op)  # (a Python handler: the wakeup fd gets the signal)
    sys.excepthook = _excepthook(sys.excepthook)
    _installed = True
    return True


def _enable_crash_stacks() -> None:
    """faulthandler on fatal signals, writing to a copy of fd 2 that silencing leaves alone."""
    global _fault_fd
    if faulthandler.is_enabled():
        return
    try:
        _fault_fd = os.dup(2)
    except OSError:  # pragma: no cover - no standard error
        return
    faulthandler.enable(file=_fault_fd, all_threads=True)


def install_from_env(environ=os.environ) -> bool:
    """``install`` when this process is a rank started by ``sdprun`` (``SDP_JOB_ID`` set)."""
    return install() if environ.get(JOB_ENV) else False

"""The interface between ``sdprun``'s supervisor and the ways of starting a rank's process.

:class:`~sdp.launcher.procs.WorkerGroup` supervises ranks (output prefixes, the first failure's
exit code, signal forwarding, stopping everything) without knowing how a rank was started; one
module per way of starting them implements :class:`Launcher` (as Horovod's runner separates its
gloo / mpi / js launchers):

* :mod:`sdp.launcher.local` -- a child process of ``sdprun`` on this machine;
* :mod:`sdp.launcher.ssh` -- a process on another host through the system OpenSSH client and
  :mod:`sdp.launcher.remote` on that host.

Engines that start every rank themselves -- Open MPI's ``mpirun`` (:mod:`sdp.launcher.mpi`) and
Slurm's ``srun`` (:mod:`sdp.launcher.slurm`) -- are not :class:`Launcher` subclasses: ``sdprun``
runs their one command as a single local "worker", and the ranks read their place from the
engine's own variables (:mod:`sdp.common.topology`).
"""
import abc
import subprocess
from typing import IO, Mapping, Optional, Sequence


class RankProcess(abc.ABC):
    """One started rank: ``proc``, the local ``Popen`` that stands for it (the rank itself, or
    its ssh client).  ``stdout`` / ``stderr`` are binary pipes carrying the rank's output."""

    def __init__(self, rank: int, proc: subprocess.Popen):
        self.rank = rank
        self.proc = proc
        self.stdout: IO[bytes] = proc.stdout
        self.stderr: IO[bytes] = proc.stderr

    @property
    def pid(self) -> int:
        """The local process id that stands for the rank."""
        return self.proc.pid

    def poll(self) -> Optional[int]:
        """The rank's ``Popen``-style return code (``-S`` when killed by signal S), None while
        it runs."""
        return self.proc.poll()

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait for the rank to end; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        return self.proc.wait(timeout=timeout)

    @abc.abstractmethod
    def signal(self, sig: int) -> None:
        """Send ``sig`` to the rank and every process it started.  ``SIGKILL`` must end the
        whole tree without the rank's cooperation.  Never raises for a rank that already ended."""

    def tree_alive(self) -> bool:
        """Whether the rank or a process it started is still running (default: :meth:`poll`)."""
        return self.poll() is None


class Launcher(abc.ABC):
    """A way of starting ranks: ``start`` one rank's ``command`` with environment ``env``."""

    #: shown in logs, e.g. ``"local"`` or ``"ssh"``
    name = "?"

    @abc.abstractmethod
    def start(self, rank: int, command: Sequence[str], env: Mapping[str, str],
              inherit_stdin: bool = False) -> RankProcess:
        """Start ``command`` as rank ``rank`` with exactly ``env`` as its environment (a remote
        launcher forwards only :func:`sdp.launcher.ssh.forwarded_env`).  ``inherit_stdin``: the
        rank reads ``sdprun``'s standard input (rank 0 of a local job), else ``/dev/null``.
        Raises ``OSError`` when the process cannot be started."""

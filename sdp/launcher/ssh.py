"""Remote ranks through the system OpenSSH client (horovodrun's ssh launch).

For each rank on another host ``sdprun`` runs::

    ssh -T -o BatchMode=yes [-p PORT] [-i IDENTITY] HOST 'exec PYTHON -c "...sdp.launcher.remote..."'

and writes the rank's job description -- command, working directory and environment, the job
secret included -- as one JSON line to ssh's standard input (see :mod:`sdp.launcher.remote`), so
no secret ever appears on a command line.  ``BatchMode=yes`` makes ssh fail at once instead of
prompting for a password or a host key; keys must be set up beforehand (``ssh-copy-id``).
``PYTHON`` is this ``sdprun``'s interpreter path: every host needs the same Python environment
at the same path (as with horovodrun).

The rank's environment on the remote host is that host's own login environment plus
:func:`forwarded_env`: ``PATH``, ``PYTHONPATH``, ``LD_LIBRARY_PATH``, every ``SDP_*``,
``HOROVOD_*`` and ``TF_*`` variable, and the names given with ``-x``.

Losing the connection ends the rank: ssh's keep-alives (``ServerAliveInterval``) end a dead
session, end-of-file on the remote side's standard input then stops the rank's whole process group.
"""
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
from typing import Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence

from sdp.launcher.base import Launcher, RankProcess
from sdp.launcher.local import pdeathsig_preexec

#: variables every remote rank gets from ``sdprun``'s environment, besides the prefixes below
FORWARD_NAMES = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "PYTHONUNBUFFERED", "GLIBC_TUNABLES")
FORWARD_PREFIXES = ("SDP_", "HOROVOD_", "TF_")
#: seconds between ssh keep-alives, and how many may go unanswered before ssh gives up
SERVER_ALIVE_INTERVAL_S = 5
SERVER_ALIVE_COUNT = 3
CONNECT_TIMEOUT_S = 10


class SshOptions(NamedTuple):
    """How to reach the hosts: ``port`` (``--ssh-port``, default ssh's own) and
    ``identity_file`` (``--ssh-identity-file``, a private key path)."""
    port: Optional[int] = None
    identity_file: Optional[str] = None


def forwarded_env(env: Mapping[str, str], names: Iterable[str] = ()) -> Dict[str, str]:
    """The part of ``env`` a remote rank gets: :data:`FORWARD_NAMES`, names starting with
    :data:`FORWARD_PREFIXES`, and ``names`` (``-x NAME``)."""
    keep = set(FORWARD_NAMES) | set(names)
    return {k: v for k, v in env.items() if k in keep or k.startswith(FORWARD_PREFIXES)}


def ssh_argv(host: str, options: SshOptions, remote_command: str) -> List[str]:
    """The ``ssh`` command line that runs ``remote_command`` (a shell string) on ``host``."""
    argv = ["ssh", "-T", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}",
            "-o", f"ServerAliveInterval={SERVER_ALIVE_INTERVAL_S}",
            "-o", f"ServerAliveCountMax={SERVER_ALIVE_COUNT}"]
    if options.port is not None:
        argv += ["-p", str(options.port)]
    if options.identity_file:
        argv += ["-i", options.identity_file, "-o", "IdentitiesOnly=yes"]
    return argv + ["--", host, remote_command]


def python_command(code: str) -> str:
    """Shell string running ``code`` with this interpreter, ``sdp`` importable from where it is
    here (the same path on every host)."""
    sdp_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    boot = f"import sys; sys.path.insert(0, {sdp_root!r}); {code}"
    return f"exec {shlex.quote(sys.executable)} -c {shlex.quote(boot)}"


REMOTE_MAIN = python_command("from sdp.launcher.remote import main; main()")


class SshProcess(RankProcess):
    """A rank started by :class:`SshLauncher`: the local ssh client that stands for it."""

    def __init__(self, rank: int, host: str, proc: subprocess.Popen):
        super().__init__(rank, proc)
        self.host = host
        self._lock = threading.Lock()

    def _send(self, line: bytes) -> bool:
        try:
            with self._lock:
                self.proc.stdin.write(line)
                self.proc.stdin.flush()
            return True
        except (OSError, ValueError):  # ssh gone or stdin closed
            return False

    def signal(self, sig: int) -> None:
        """``sig`` to the rank's process group on its host; SIGKILL closes the session instead
        (the remote side then kills the group) and kills the local ssh client."""
        if self.proc.poll() is not None:
            return
        if sig != signal.SIGKILL and self._send(f"signal {int(sig)}\n".encode()):
            return
        try:
            self.proc.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass


class SshLauncher(Launcher):
    """Start ranks on ``host`` through ``ssh`` and :mod:`sdp.launcher.remote`.

    ``cwd`` (default: ``sdprun``'s working directory) is where the rank starts on the host;
    ``forward`` names extra variables to forward (``-x NAME``); ``grace_s`` is how long the
    remote side waits between SIGTERM and SIGKILL when the session ends."""

    name = "ssh"

    def __init__(self, host: str, options: SshOptions = SshOptions(), cwd: Optional[str] = None,
                 forward: Sequence[str] = (), grace_s: float = 3.0):
        self.host = host
        self.options = options
        self.cwd = cwd or os.getcwd()
        self.forward = tuple(forward)
        self.grace_s = grace_s

    def start(self, rank: int, command: Sequence[str], env: Mapping[str, str],
              inherit_stdin: bool = False) -> SshProcess:
        spec = {"command": list(command), "env": forwarded_env(env, self.forward),
                "cwd": self.cwd, "grace_s": self.grace_s}
        proc = subprocess.Popen(ssh_argv(self.host, self.options, REMOTE_MAIN),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, preexec_fn=pdeathsig_preexec())
        p = SshProcess(rank, self.host, proc)
        if not p._send(json.dumps(spec).encode() + b"\n"):
            p.signal(signal.SIGKILL)  # ssh failed at once; its message is on its stderr
        return p


# ---------------------------------------------------------------- sdprun --check

PROBE = python_command(
    "import json, os, platform, shutil, sys; from sdp.common import network; import sdp; "
    "t = sys.argv[1] if len(sys.argv) > 1 else None; "
    "a = network.address_towards(t) if t else None; "
    "print(json.dumps({'hostname': platform.node(), 'python': platform.python_version(), "
    "'sdp': sdp.__version__, 'shm_free': shutil.disk_usage('/dev/shm').free "
    "if os.path.isdir('/dev/shm') else None, 'address': a, "
    "'iface': network.interface_of(a) if a else None}))")


def probe_host(host: str, options: SshOptions, towards: Optional[str], local: bool,
               timeout_s: float = 30.0) -> dict:
    """Run :data:`PROBE` on ``host`` (through ssh unless ``local``) and return its answer:
    ``hostname``, ``python``, ``sdp`` (versions), ``shm_free`` (bytes free in ``/dev/shm``),
    ``address`` / ``iface`` (the address and interface the host uses towards ``towards``).  On
    failure ``{"error": message}``."""
    probe = PROBE + (" " + shlex.quote(towards) if towards else "")
    argv = ["sh", "-c", probe] if local else ssh_argv(host, options, probe)
    try:
        res = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                             timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"no answer within {timeout_s:g} s"}
    except OSError as e:
        return {"error": f"cannot run {argv[0]}: {e}"}
    if res.returncode != 0:
        lines = (res.stderr.strip() or res.stdout.strip() or f"exit status {res.returncode}").splitlines()
        return {"error": lines[-1]}
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"unexpected answer {res.stdout[-200:]!r}"}

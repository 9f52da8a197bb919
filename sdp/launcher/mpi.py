"""``mpirun`` as a launcher only (``sdprun --launcher mpi``), as ``horovodrun --mpi`` does.

``sdprun --launcher mpi -np 4 -H h1:2,h2:2 python train.py`` serves the rendezvous and makes the job
secret as usual, then runs one Open MPI ``mpirun`` that starts all ranks (through its own ``orted``
daemons, reached with ssh)::

    mpirun -np 4 -H h1:2,h2:2 --bind-to none --map-by slot --tag-output [--allow-run-as-root]
           -mca plm_rsh_agent ssh -mca plm_rsh_args "-o BatchMode=yes [-p PORT] [-i FILE]"
           [-mca oob_tcp_if_include IFACE -mca btl_tcp_if_include IFACE]
           -x NAME -x NAME ... python train.py

Every ``-x`` is a bare name, so Open MPI copies the value from ``mpirun``'s own environment:
``SDP_SECRET`` (and every other value) never appears on a command line.  The names are those an
ssh-launched rank gets (:func:`sdp.launcher.ssh.forwarded_env`: ``PATH``, ``PYTHONPATH``,
``LD_LIBRARY_PATH``, every ``SDP_*``, ``HOROVOD_*``, ``TF_*``, and ``sdprun -x`` names).  The ranks
get no ``SDP_RANK``: they read their place from Open MPI's ``OMPI_COMM_WORLD_RANK`` / ``_SIZE`` /
``_LOCAL_RANK`` / ``_LOCAL_SIZE`` (:mod:`sdp.common.topology`, source ``OMPI``) and rendezvous at
``SDP_RENDEZVOUS_ADDR``.  Output lines carry ``mpirun``'s ``--tag-output`` prefix
``[JOBID,RANK]<stdout>:`` on every piece of output it forwards (a line a rank writes in
several pieces carries several tags).  ``mpirun`` ends every rank when one fails and exits non-zero.

No MPI library is loaded by sdp (no mpi4py): ``mpirun`` only places and starts processes.

A plain ``mpirun`` works too; rank 0 then serves the rendezvous at ``MASTER_ADDR:MASTER_PORT``::

    export SDP_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')
    mpirun -np 4 -H h1:2,h2:2 --bind-to none -x MASTER_ADDR=h1 -x MASTER_PORT=29500 -x SDP_SECRET \\
           python train.py
"""
import os
import shlex
import shutil
from typing import Iterable, List, Mapping, Optional, Sequence

from sdp.launcher.hosts import HostSlots
from sdp.launcher.ssh import CONNECT_TIMEOUT_S, SshOptions, forwarded_env

MPIRUN = "mpirun"


def find_mpirun(env: Optional[Mapping[str, str]] = None) -> str:
    """The path of ``mpirun`` on ``PATH``; raises ``FileNotFoundError`` naming the package."""
    path = shutil.which(MPIRUN, path=(env or os.environ).get("PATH"))
    if path is None:
        raise FileNotFoundError("--launcher mpi needs Open MPI's mpirun on PATH "
                                "(Debian/Ubuntu: apt-get install openmpi-bin)")
    return path


def rsh_args(options: SshOptions) -> str:
    """``plm_rsh_args``: the options ``mpirun`` gives ssh to reach the hosts (no prompts)."""
    args = ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}"]
    if options.port is not None:
        args += ["-p", str(options.port)]
    if options.identity_file:
        args += ["-i", options.identity_file, "-o", "IdentitiesOnly=yes"]
    return shlex.join(args)


def mpirun_argv(hosts: Sequence[HostSlots], np: int, command: Sequence[str], export: Iterable[str],
                options: SshOptions = SshOptions(), nic: Optional[str] = None,
                mpirun: str = MPIRUN, as_root: Optional[bool] = None) -> List[str]:
    """The ``mpirun`` command line starting ``np`` ranks of ``command`` on ``hosts`` (filled
    slot by slot, as ``sdprun`` places ranks), exporting the variables named in ``export`` (names
    only: values come from ``mpirun``'s environment).  ``nic`` keeps Open MPI's own traffic on
    that interface.  ``as_root`` (default: whether this process is root) adds
    ``--allow-run-as-root``."""
    argv = [mpirun, "-np", str(np), "-H", ",".join(f"{h.host}:{h.slots}" for h in hosts),
            "--bind-to", "none", "--map-by", "slot", "--tag-output"]
    if os.geteuid() == 0 if as_root is None else as_root:
        argv.append("--allow-run-as-root")
    argv += ["-mca", "plm_rsh_agent", "ssh", "-mca", "plm_rsh_args", rsh_args(options)]
    if nic:
        argv += ["-mca", "oob_tcp_if_include", nic, "-mca", "btl_tcp_if_include", nic]
    for name in sorted(set(export)):
        argv += ["-x", name]
    return argv + list(command)


def exported_names(env: Mapping[str, str], extra: Iterable[str] = ()) -> List[str]:
    """The names of ``env`` that ranks get (those an ssh-launched rank gets, plus ``extra``)."""
    return sorted(forwarded_env(env, extra))

"""Slurm's ``srun`` as a launcher (``sdprun --launcher slurm``; the default inside an allocation,
i.e. with ``SLURM_JOB_ID`` set and no ``-H`` / ``--hostfile``).

Inside ``salloc`` / ``sbatch``, ``sdprun -np 4 python train.py`` serves the rendezvous and makes the
job secret as usual, then runs one job step that starts every rank::

    srun --ntasks 4 --kill-on-bad-exit=1 --quit-on-interrupt --label [--nodes N] python train.py

The ranks inherit ``srun``'s environment (Slurm's default ``--export=ALL``) with
``SDP_RENDEZVOUS_ADDR``, ``SDP_SECRET`` and the other job variables, but no ``SDP_RANK``: they
read their place from ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID`` and the step's
tasks-per-node list (:mod:`sdp.common.topology`, source ``SLURM``).  ``--kill-on-bad-exit=1`` makes
Slurm end the step when a rank fails, ``--quit-on-interrupt`` makes the SIGINT ``sdprun``
forwards (Ctrl-C) end it at once (``srun`` would only print the tasks' state); ``sdprun`` exits
with ``srun``'s status.  Output lines carry
``srun``'s ``--label`` prefix ``RANK: ``.

Without ``sdprun``, ``srun -N 2 --ntasks-per-node 2 python train.py`` works as well: rank 0
serves the rendezvous on the step's first node (see :func:`sdp.common.topology.slurm_rendezvous_port`);
the job secret then comes from ``SDP_SECRET`` or ``SDP_SECRET_FILE`` set in the batch script.
"""
import os
import shutil
from typing import List, Mapping, Optional, Sequence

from sdp.common import topology

SRUN = "srun"


def in_allocation(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process runs inside a Slurm allocation (``SLURM_JOB_ID`` is set)."""
    return bool((os.environ if env is None else env).get("SLURM_JOB_ID"))


def find_srun(env: Optional[Mapping[str, str]] = None) -> str:
    """The path of ``srun`` on ``PATH``; raises ``FileNotFoundError`` naming the package."""
    path = shutil.which(SRUN, path=(env or os.environ).get("PATH"))
    if path is None:
        raise FileNotFoundError("--launcher slurm needs Slurm's srun on PATH (apt-get install slurm-client)")
    return path


def allocation_nodes(env: Optional[Mapping[str, str]] = None) -> List[str]:
    """The allocation's nodes (``SLURM_JOB_NODELIST``, expanded); [] outside an allocation.
    Raises :class:`~sdp.common.errors.TopologyError` for a malformed list."""
    env = os.environ if env is None else env
    for name in ("SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(name):
            return topology.expand_nodelist(env[name], name)
    return []


def default_ntasks(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The allocation's task count (``SLURM_NTASKS``), None when not set or not an integer."""
    value = (os.environ if env is None else env).get("SLURM_NTASKS", "")
    return int(value) if value.isdigit() else None


def srun_argv(np: int, command: Sequence[str], nodes: Optional[int] = None, srun: str = SRUN) -> List[str]:
    """The ``srun`` command line starting ``np`` ranks of ``command`` (on ``nodes`` nodes, default:
    as Slurm places them in the allocation)."""
    argv = [srun, "--ntasks", str(np), "--kill-on-bad-exit=1", "--quit-on-interrupt", "--label"]
    if nodes:
        argv += ["--nodes", str(nodes)]
    return argv + list(command)

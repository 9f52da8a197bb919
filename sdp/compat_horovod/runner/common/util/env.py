"""``horovod.runner.common.util.env`` on sdp: the rank and size of this process from the
environment, and which variables a launcher forwards.

- ``get_env_rank_and_size()``: ``(rank, size)`` as ints from the first pair present of
  ``HOROVOD_RANK``/``HOROVOD_SIZE`` (``sdprun`` exports them, see :mod:`sdp.launcher.hosts`),
  ``OMPI_COMM_WORLD_RANK``/``_SIZE``, ``PMI_RANK``/``PMI_SIZE``; ``(0, 1)`` when none is set.
  ``RuntimeError`` naming both variables when only one of a pair is set.
- ``is_exportable(name)``: False for the names ``IGNORE_REGEXES`` match (shell functions,
  ``OLDPWD``, ``*CUDA_VISIBLE_DEVICES``, Horovod's and sdp's job secrets).
- ``is_kubeflow_mpi()``: ``OMPI_MCA_plm_rsh_agent`` is Kubeflow's ``KUBEFLOW_MPI_EXEC``.
- ``LOG_LEVEL_STR``: Horovod's log level names.

Mirrors Horovod's module of that name.
"""
import os
import re

LOG_LEVEL_STR = ["FATAL", "ERROR", "WARNING", "INFO", "DEBUG", "TRACE"]
HOROVOD_SECRET_KEY = "_HOROVOD_SECRET_KEY"
IGNORE_REGEXES = {"BASH_FUNC_.*", "OLDPWD", ".*CUDA_VISIBLE_DEVICES", HOROVOD_SECRET_KEY,
                  "SDP_SECRET"}  # sdp's job secret (sdp.transport.security.SECRET_ENV)
KUBEFLOW_MPI_EXEC = "/etc/mpi/kubexec.sh"

_RANK_SIZE_VARS = [("HOROVOD_RANK", "HOROVOD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                   ("PMI_RANK", "PMI_SIZE")]


def is_exportable(v: str) -> bool:
    """False if environment variable name ``v`` must not be passed on to workers."""
    return not any(re.match(r, v) for r in IGNORE_REGEXES)


def get_env_rank_and_size():
    """``(rank, size)`` of this process from the environment (see the module docstring)."""
    for rank_var, size_var in _RANK_SIZE_VARS:
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is not None and size is not None:
            return int(rank), int(size)
        if rank is not None or size is not None:
            raise RuntimeError(f"Could not determine process rank and size: only one of {rank_var} and "
                               f"{size_var} found in environment")
    return 0, 1


def is_kubeflow_mpi() -> bool:
    """True inside a Kubeflow MPIJob launcher (``OMPI_MCA_plm_rsh_agent`` is ``KUBEFLOW_MPI_EXEC``)."""
    return os.environ.get("OMPI_MCA_plm_rsh_agent") == KUBEFLOW_MPI_EXEC

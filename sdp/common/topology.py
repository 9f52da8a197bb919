"""Where this process sits in the job: rank, world size, local rank/size, cross rank/size.

Read from the environment by ``from_env``, first match wins:

============  =====================================================================================
source        variables (a source matches when its rank and size variables are both present)
============  =====================================================================================
SDP           ``SDP_RANK``, ``SDP_SIZE``, ``SDP_LOCAL_RANK``, ``SDP_LOCAL_SIZE``,
              ``SDP_CROSS_RANK``, ``SDP_CROSS_SIZE``, ``SDP_RENDEZVOUS_ADDR`` (set by ``sdprun``)
HOROVOD       ``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``, ``HOROVOD_LOCAL_SIZE``,
              ``HOROVOD_CROSS_RANK``, ``HOROVOD_CROSS_SIZE`` (``horovodrun``, Gloo mode)
OMPI          ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK``,
              ``OMPI_COMM_WORLD_LOCAL_SIZE`` (Open MPI's ``mpirun``)
PMI           ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``
              (MPICH / Intel MPI / hydra)
SLURM         ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` or ``SLURM_NTASKS``, ``SLURM_LOCALID``,
              ``SLURM_NODEID``, ``SLURM_STEP_NUM_NODES`` / ``SLURM_NNODES`` / ``SLURM_JOB_NUM_NODES``,
              tasks per node from ``SLURM_STEP_TASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE`` /
              ``SLURM_NTASKS_PER_NODE`` (``srun``; step values are preferred to job values)
SAGEMAKER     ``SM_HOSTS`` (JSON list), ``SM_CURRENT_HOST``: one process per host
TF_CONFIG     ``TF_CONFIG`` (JSON; Kubeflow's TFJob): ranks in the order of the ``chief``,
              ``master`` and ``worker`` lists, one process per pod
TORCHRUN      ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
              ``GROUP_WORLD_SIZE`` (``torchrun``, Kubeflow's PyTorchJob and other operators)
INDEXED_JOB   ``JOB_COMPLETION_INDEX`` (set by Kubernetes in an Indexed Job's pods),
              ``WORLD_SIZE`` (set in the manifest): one process per pod
default       nothing of the above: a world of size 1, so scripts run unchanged
============  =====================================================================================

The SDP source is taken literally (missing local/cross values are 0/1; the rendezvous address is
``SDP_RENDEZVOUS_ADDR``, served by ``sdprun``).  For every other source:

* Rendezvous: ``SDP_RENDEZVOUS_ADDR`` if set (someone else serves it, ``serve_rendezvous=False``),
  else ``tcp://{MASTER_ADDR}:{MASTER_PORT}`` with ``serve_rendezvous=True`` (rank 0 serves it;
  ``MASTER_PORT`` defaults to ``DEFAULT_RENDEZVOUS_PORT``).  When ``MASTER_ADDR`` is unset,
  Slurm falls back to the first node of ``SLURM_STEP_NODELIST`` / ``SLURM_JOB_NODELIST``
  (expanded with python-hostlist) at the port ``slurm_rendezvous_port`` derives from
  ``SLURM_JOB_ID`` and ``SLURM_STEP_ID``; SageMaker to the first of the sorted ``SM_HOSTS``;
  ``TF_CONFIG`` to the ``host:port`` of its first chief/master/worker.  Horovod's own
  ``HOROVOD_GLOO_RENDEZVOUS_ADDR``/``_PORT`` is an HTTP server that does not speak our protocol and
  is ignored.  Under ``torchrun`` with ``TORCHELASTIC_USE_AGENT_STORE=True`` the port
  ``MASTER_PORT`` is already taken by torchrun's own TCPStore, so ``MASTER_PORT + 1`` is used.
  World size > 1 with no rendezvous address raises ``TopologyError``.
* Local rank/size: when the launcher gives neither, each process is assumed to run on its own
  host (local rank 0, local size 1).  A local rank without a local size (or a local size > 1
  without a local rank) raises ``TopologyError`` rather than guessing.
* Cross rank/size (Horovod's meaning: the rank among the processes with the same local rank on
  the other hosts; with a uniform layout, the host index and the number of hosts): taken from the
  launcher where it says them (``HOROVOD_CROSS_*``, ``GROUP_RANK``/``GROUP_WORLD_SIZE``, Slurm's
  node id and tasks per node).  Otherwise, when ``local_size`` divides ``size``, they are derived
  assuming *contiguous placement* (ranks ``k*local_size ... (k+1)*local_size-1`` on host ``k``,
  which is what ``mpirun``'s default by-slot/by-core mapping and ``torchrun`` produce):
  ``cross_size = size // local_size`` and ``cross_rank = rank // local_size``.  When they cannot
  be derived (non-uniform placement), they are 0 and 1 until rendezvous.
* After rendezvous (``sdp.init()``), every value that was assumed or derived above (not given by
  the launcher; ``Topology.assumed``) is recomputed from the host names all ranks registered
  (``Topology.with_hosts``), so round-robin placement and uneven hosts get the right values.
* ``hostname`` is ``SDP_HOSTNAME`` if set, else ``socket.gethostname``.
* A value that is not an integer raises ``TopologyError`` naming the variable; so does an
  impossible topology (rank >= size, local rank >= local size, ...).
"""
import dataclasses
import json
import os
import socket
from typing import Callable, List, Mapping, Optional, Tuple

import hostlist

from sdp.common.errors import TopologyError

#: Port used with ``MASTER_ADDR`` (or SageMaker's first host) when ``MASTER_PORT`` is not set;
#: the same default as ``torchrun``.
DEFAULT_RENDEZVOUS_PORT = 29500


@dataclasses.dataclass(frozen=True)
class Topology:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    hostname: str = dataclasses.field(default_factory=socket.gethostname)
    rendezvous_addr: Optional[str] = None  # tcp://host:port
    serve_rendezvous: bool = False  # true: rank 0 hosts the rendezvous server itself
    source: str = "default"  # which environment family the values came from
    assumed: Tuple[str, ...] = ()  # "local" / "cross": values not given by the launcher

    def with_hosts(self, hosts: List[str]) -> "Topology":
        """This topology with its ``assumed`` values computed from every rank's host name
        (``hosts[r]``, as registered at rendezvous).  Local rank/size: this rank's index among
        the ranks on its host (in rank order) and their number.  Cross rank/size: this rank's
        index among the ranks with the same local rank (one per host, in rank order) and their
        number.  Returns ``self`` when nothing was assumed or ``hosts`` is not one per rank."""
        if not self.assumed or len(hosts) != self.size:
            return self
        count: dict = {}
        local = []  # local rank of every rank
        for host in hosts:
            local.append(count.get(host, 0))
            count[host] = local[-1] + 1
        values = {"assumed": ()}
        if "local" in self.assumed:
            values.update(local_rank=local[self.rank], local_size=count[hosts[self.rank]])
        if "cross" in self.assumed:
            peers = [r for r in range(self.size) if local[r] == local[self.rank]]
            values.update(cross_rank=peers.index(self.rank), cross_size=len(peers))
        return dataclasses.replace(self, **values)

    def __post_init__(self):
        checks = [
            (self.size >= 1, f"world size must be >= 1, got {self.size}"),
            (0 <= self.rank < self.size, f"rank {self.rank} is outside [0, {self.size})"),
            (self.local_size >= 1, f"local size must be >= 1, got {self.local_size}"),
            (0 <= self.local_rank < self.local_size,
             f"local rank {self.local_rank} is outside [0, {self.local_size})"),
            (0 <= self.cross_rank < self.cross_size,
             f"cross rank {self.cross_rank} is outside [0, {self.cross_size})"),
            (self.size == 1 or self.rendezvous_addr,
             f"world size {self.size} needs a rendezvous address (SDP_RENDEZVOUS_ADDR or MASTER_ADDR/MASTER_PORT)"),
        ]
        for ok, msg in checks:
            if not ok:
                raise TopologyError(f"bad topology from {self.source} environment: {msg}")


def _int(env, name):
    try:
        return int(env[name])
    except ValueError:
        raise TopologyError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _first(env, names) -> Optional[str]:
    """The first of ``names`` present in ``env``, or None."""
    for name in names:
        if name in env:
            return name
    return None


def _first_int(env, names) -> Tuple[Optional[int], Optional[str]]:
    """(value, variable) of the first of ``names`` present in ``env``; (None, None) if none is."""
    name = _first(env, names)
    return (None, None) if name is None else (_int(env, name), name)


# --------------------------------------------------------------------------------------------
# What a launcher says, before the gaps are filled.


@dataclasses.dataclass
class _Raw:
    rank: int
    size: int
    local_rank: Optional[int] = None
    local_size: Optional[int] = None
    cross_rank: Optional[int] = None
    cross_size: Optional[int] = None
    default_master_host: Optional[str] = None  # rendezvous host when MASTER_ADDR is unset
    default_master_port: int = DEFAULT_RENDEZVOUS_PORT  # rendezvous port when MASTER_PORT is unset
    port_offset: int = 0  # added to MASTER_PORT (torchrun's agent store occupies MASTER_PORT)


@dataclasses.dataclass(frozen=True)
class _Source:
    """One launcher family: the variables it sets, as alternatives in order of preference.

    ``rank`` and ``size`` must both be present for the source to match.  ``adjust`` (optional)
    refines what the plain variables give (Slurm's tasks-per-node, torchrun's agent store).
    ``read`` (optional) replaces the variable lookup altogether (SageMaker).
    """
    name: str
    rank: Tuple[str, ...] = ()
    size: Tuple[str, ...] = ()
    local_rank: Tuple[str, ...] = ()
    local_size: Tuple[str, ...] = ()
    cross_rank: Tuple[str, ...] = ()
    cross_size: Tuple[str, ...] = ()
    adjust: Optional[Callable[[Mapping[str, str], _Raw], None]] = None
    read: Optional[Callable[[Mapping[str, str]], Optional[_Raw]]] = None

    def raw(self, env) -> Optional[_Raw]:
        """What ``env`` says for this source, or None when the source does not match."""
        if self.read is not None:
            return self.read(env)
        if _first(env, self.rank) is None or _first(env, self.size) is None:
            return None
        raw = _Raw(rank=_first_int(env, self.rank)[0], size=_first_int(env, self.size)[0],
                   local_rank=_first_int(env, self.local_rank)[0],
                   local_size=_first_int(env, self.local_size)[0],
                   cross_rank=_first_int(env, self.cross_rank)[0],
                   cross_size=_first_int(env, self.cross_size)[0])
        if self.adjust is not None:
            self.adjust(env, raw)
        return raw


# --------------------------------------------------------------------------------------------
# Slurm


_SLURM_TASKS_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
_SLURM_NNODES = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
_SLURM_NODELIST = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
#: Plain ``srun`` jobs rendezvous on their first node at
#: ``SLURM_PORT_BASE + (SLURM_JOB_ID * 7 + SLURM_STEP_ID) % SLURM_PORT_SPAN`` (20000-29999: below
#: Linux's ephemeral ports, so no outgoing connection holds it), so that concurrent steps of one
#: allocation and neighbouring jobs on a shared first node get different ports.
SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 10000


def expand_slurm_tasks_per_node(value: str, name: str = "SLURM_TASKS_PER_NODE") -> List[int]:
    """Expand Slurm's compressed tasks-per-node list into one count per node, with
    python-hostlist's ``hostlist.parse_slurm_tasks_per_node``.

    ``"4"`` -> ``[4]``, ``"4(x2)"`` -> ``[4, 4]``, ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.
    Raises ``TopologyError`` (naming ``name``) on anything else, or on a zero count.
    """
    try:
        counts = hostlist.parse_slurm_tasks_per_node(value)
    except hostlist.BadHostlist:
        counts = []
    if not counts or min(counts) < 1:
        raise TopologyError(
            f"environment variable {name}={value!r} is not a Slurm tasks-per-node list "
            "(expected e.g. '4', '4(x2)' or '2(x3),1')")
    return counts


def expand_nodelist(value: str, name: str = "SLURM_JOB_NODELIST") -> List[str]:
    """Expand a Slurm host list (``"n[1-3,7],gpu05"`` -> ``["n1", "n2", "n3", "n7", "gpu05"]``)
    with python-hostlist's ``hostlist.expand_hostlist``.  Raises ``TopologyError`` (naming
    ``name``) when it is malformed or empty."""
    try:
        nodes = hostlist.expand_hostlist(value)
    except hostlist.BadHostlist as e:
        raise TopologyError(f"environment variable {name}={value!r} is not a Slurm host list: {e}") from None
    if not nodes:
        raise TopologyError(f"environment variable {name}={value!r} names no node")
    return nodes


def slurm_rendezvous_port(job_id: int, step_id: int = 0) -> int:
    """The port a plain ``srun`` job step rendezvous on (see ``SLURM_PORT_BASE``)."""
    return SLURM_PORT_BASE + (job_id * 7 + step_id) % SLURM_PORT_SPAN


def _slurm_adjust(env, raw: _Raw) -> None:
    """Local size and cross rank/size from Slurm's node id and tasks-per-node list; the
    rendezvous default: the step's first node, port ``slurm_rendezvous_port``."""
    nodelist_var = _first(env, _SLURM_NODELIST)
    if nodelist_var is not None:
        raw.default_master_host = expand_nodelist(env[nodelist_var], nodelist_var)[0]
    if "SLURM_JOB_ID" in env:
        step = env.get("SLURM_STEP_ID", "")
        raw.default_master_port = slurm_rendezvous_port(
            _int(env, "SLURM_JOB_ID"), _int(env, "SLURM_STEP_ID") if step.isdigit() else 0)
    nodeid, nodeid_var = _first_int(env, ("SLURM_NODEID",))
    nnodes, nnodes_var = _first_int(env, _SLURM_NNODES)
    tpn_var = _first(env, _SLURM_TASKS_PER_NODE)
    counts = None
    if tpn_var is not None:
        counts = expand_slurm_tasks_per_node(env[tpn_var], tpn_var)
        if len(counts) == 1 and nnodes is None and raw.size % counts[0] == 0:
            counts = counts * (raw.size // counts[0])  # a bare per-node count: uniform layout
        elif len(counts) == 1 and nnodes is not None:
            counts = counts * nnodes
        if nnodes is not None and len(counts) != nnodes:
            raise TopologyError(
                f"inconsistent Slurm environment: {tpn_var}={env[tpn_var]!r} describes "
                f"{len(counts)} nodes but {nnodes_var}={nnodes}")
        if sum(counts) != raw.size:
            raise TopologyError(
                f"inconsistent Slurm environment: {tpn_var}={env[tpn_var]!r} adds up to "
                f"{sum(counts)} tasks but the world size is {raw.size}")
    elif nnodes is not None and nnodes >= 1 and raw.size % nnodes == 0:
        counts = [raw.size // nnodes] * nnodes  # no per-node list: assume a uniform layout
    if counts is None:
        return
    if nodeid is not None:
        if not 0 <= nodeid < len(counts):
            raise TopologyError(
                f"inconsistent Slurm environment: {nodeid_var}={nodeid} but the job has {len(counts)} nodes")
        raw.local_size = counts[nodeid]
        lr = raw.local_rank
        if lr is not None and 0 <= lr < raw.local_size:
            # Horovod's cross communicator: the processes with this local rank, one per node.
            raw.cross_size = sum(1 for c in counts if c > lr)
            raw.cross_rank = sum(1 for c in counts[:nodeid] if c > lr)
    elif len(set(counts)) == 1:
        raw.local_size = counts[0]


# --------------------------------------------------------------------------------------------
# SageMaker


def _sagemaker_read(env) -> Optional[_Raw]:
    """One process per host: rank = index of SM_CURRENT_HOST in the sorted SM_HOSTS."""
    if "SM_HOSTS" not in env or "SM_CURRENT_HOST" not in env:
        return None
    try:
        hosts = json.loads(env["SM_HOSTS"])
    except ValueError:
        hosts = None
    if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) and h for h in hosts):
        raise TopologyError(
            f"environment variable SM_HOSTS={env['SM_HOSTS']!r} is not a JSON list of host names")
    hosts = sorted(hosts)
    if len(set(hosts)) != len(hosts):
        raise TopologyError(f"environment variable SM_HOSTS={env['SM_HOSTS']!r} names a host twice")
    current = env["SM_CURRENT_HOST"]
    if current not in hosts:
        raise TopologyError(
            f"environment variable SM_CURRENT_HOST={current!r} is not one of SM_HOSTS={env['SM_HOSTS']!r}")
    rank = hosts.index(current)
    return _Raw(rank=rank, size=len(hosts), local_rank=0, local_size=1,
                cross_rank=rank, cross_size=len(hosts), default_master_host=hosts[0])


# --------------------------------------------------------------------------------------------
# Kubeflow TFJob


TF_CONFIG_RANKED = ("chief", "master", "worker")  # TF_CONFIG task types that get ranks, in order


def _tf_config_read(env) -> Optional[_Raw]:
    """Ranks in the order chief, master, worker; rendezvous at the first of them (its
    ``host:port``, the port the operator reserved for the task)."""
    if "TF_CONFIG" not in env:
        return None
    bad = f"environment variable TF_CONFIG={env['TF_CONFIG']!r}"
    try:
        cfg = json.loads(env["TF_CONFIG"])
        cluster, task = cfg["cluster"], cfg["task"]
        kind, index = task["type"], task["index"]
        members = [a for k in TF_CONFIG_RANKED for a in cluster.get(k, [])]
        ok = (isinstance(kind, str) and isinstance(index, int) and index >= 0
              and all(isinstance(a, str) and a for a in members))
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise TopologyError(f"{bad} is not a TF_CONFIG ({{'cluster': {{'worker': ['host:port', ...]}}, "
                            "'task': {'type': 'worker', 'index': 0}})")
    if kind not in TF_CONFIG_RANKED:
        raise TopologyError(f"{bad}: task type {kind!r} has no rank in a data-parallel job "
                            f"(only {', '.join(TF_CONFIG_RANKED)} replicas run sdp)")
    if index >= len(cluster.get(kind) or []):
        raise TopologyError(f"{bad}: task {kind} {index} is not in the cluster's {kind} list")
    rank = sum(len(cluster.get(k) or []) for k in TF_CONFIG_RANKED[:TF_CONFIG_RANKED.index(kind)]) + index
    host, _, port = members[0].rpartition(":")
    if not host or not port.isdigit():
        raise TopologyError(f"{bad}: {members[0]!r} is not host:port")
    return _Raw(rank=rank, size=len(members), default_master_host=host.strip("[]"),
                default_master_port=int(port))


# --------------------------------------------------------------------------------------------
# torchrun


def _torchrun_adjust(env, raw: _Raw) -> None:
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raw.port_offset = 1  # torchrun's agent already serves its TCPStore on MASTER_PORT


#: The launcher families after SDP, in order of precedence.
_SOURCES: Tuple[_Source, ...] = (
    _Source("HOROVOD",
            rank=("HOROVOD_RANK",), size=("HOROVOD_SIZE",),
            local_rank=("HOROVOD_LOCAL_RANK",), local_size=("HOROVOD_LOCAL_SIZE",),
            cross_rank=("HOROVOD_CROSS_RANK",), cross_size=("HOROVOD_CROSS_SIZE",)),
    # OMPI_COMM_WORLD_NODE_RANK is not a cross rank (it is a per-node rank across all jobs);
    # Open MPI has no cross variables, so they are derived.
    _Source("OMPI",
            rank=("OMPI_COMM_WORLD_RANK",), size=("OMPI_COMM_WORLD_SIZE",),
            local_rank=("OMPI_COMM_WORLD_LOCAL_RANK",), local_size=("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    _Source("PMI",
            rank=("PMI_RANK",), size=("PMI_SIZE",),
            local_rank=("MPI_LOCALRANKID",), local_size=("MPI_LOCALNRANKS",)),
    _Source("SLURM",
            rank=("SLURM_PROCID",), size=("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
            local_rank=("SLURM_LOCALID",), adjust=_slurm_adjust),
    _Source("SAGEMAKER", read=_sagemaker_read),
    _Source("TF_CONFIG", read=_tf_config_read),
    _Source("TORCHRUN",
            rank=("RANK",), size=("WORLD_SIZE",),
            local_rank=("LOCAL_RANK",), local_size=("LOCAL_WORLD_SIZE",),
            cross_rank=("GROUP_RANK",), cross_size=("GROUP_WORLD_SIZE",), adjust=_torchrun_adjust),
    # A Kubernetes Indexed Job: the Job controller sets JOB_COMPLETION_INDEX; the manifest sets
    # WORLD_SIZE (= completions) and MASTER_ADDR (pod 0 through the headless Service).
    _Source("INDEXED_JOB", rank=("JOB_COMPLETION_INDEX",), size=("WORLD_SIZE",)),
)

#: Names of every source, in order of precedence (what ``Topology.source`` can be).
SOURCES: Tuple[str, ...] = ("SDP",) + tuple(s.name for s in _SOURCES) + ("default",)


# --------------------------------------------------------------------------------------------
# Filling the gaps


def _complete_local(src: _Source, raw: _Raw) -> Tuple[int, int]:
    lr, ls = raw.local_rank, raw.local_size
    if lr is None and ls is None:
        return 0, 1  # size 1, or (documented assumption) one process per host
    if ls is None:
        if raw.size == 1:
            return lr, 1
        raise TopologyError(
            f"the {src.name} environment gives a local rank ({lr}) but no local size; "
            f"set {' or '.join(src.local_size) or 'the local size'}")
    if lr is None:
        if ls == 1:
            return 0, 1
        raise TopologyError(
            f"the {src.name} environment gives a local size ({ls}) but no local rank; "
            f"set {' or '.join(src.local_rank) or 'the local rank'}")
    return lr, ls


def _complete_cross(raw: _Raw, local_size: int) -> Tuple[int, int]:
    cr, cs = raw.cross_rank, raw.cross_size
    if cr is not None and cs is not None:
        return cr, cs
    if local_size >= 1 and raw.size % local_size == 0:
        # Contiguous placement: host k runs ranks k*local_size .. (k+1)*local_size - 1.
        return (raw.rank // local_size if cr is None else cr,
                raw.size // local_size if cs is None else cs)
    return 0, 1  # non-uniform placement: unknown


def _rendezvous(env, src_name: str, raw: _Raw) -> Tuple[Optional[str], bool]:
    """(rendezvous_addr, serve_rendezvous) for a non-SDP source.  ``SDP_RENDEZVOUS_ADDR`` set by
    one of sdp's launchers (which also set ``SDP_JOB_ID``: ``sdprun --launcher mpi|slurm``, Ray)
    is served by that launcher; set by the user (``mpirun -x SDP_RENDEZVOUS_ADDR ...``) it is
    served by rank 0, as ``MASTER_ADDR:MASTER_PORT`` is."""
    addr = env.get("SDP_RENDEZVOUS_ADDR")
    if addr:
        return addr, not env.get("SDP_JOB_ID")
    host = env.get("MASTER_ADDR") or raw.default_master_host
    if host:
        port = _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else raw.default_master_port
        port += raw.port_offset
        if not 1 <= port <= 65535:
            raise TopologyError(f"rendezvous port {port} (from MASTER_PORT) is outside [1, 65535]")
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # IPv6 literal
        return f"tcp://{host}:{port}", True
    if raw.size > 1:
        raise TopologyError(
            f"the {src_name} environment describes {raw.size} processes but no rendezvous address: "
            "set MASTER_ADDR (and MASTER_PORT, default "
            f"{DEFAULT_RENDEZVOUS_PORT}) to the host of rank 0, which then serves the rendezvous, "
            "or SDP_RENDEZVOUS_ADDR=tcp://host:port on the host of rank 0, which then serves it "
            "(or launch with sdprun, which sets everything)")
    return None, False


def _from_source(env, src: _Source, raw: _Raw) -> Topology:
    local_rank, local_size = _complete_local(src, raw)
    if local_size > raw.size >= 1:
        raise TopologyError(
            f"bad topology from {src.name} environment: local size {local_size} "
            f"exceeds world size {raw.size}")
    cross_rank, cross_size = _complete_cross(raw, local_size)
    addr, serve = _rendezvous(env, src.name, raw)
    assumed = tuple(what for what, given in (("local", raw.local_rank is not None or raw.local_size is not None),
                                             ("cross", raw.cross_rank is not None and raw.cross_size is not None))
                    if raw.size > 1 and not given)
    return Topology(
        rank=raw.rank, size=raw.size, local_rank=local_rank, local_size=local_size,
        cross_rank=cross_rank, cross_size=cross_size,
        hostname=env.get("SDP_HOSTNAME") or socket.gethostname(),
        rendezvous_addr=addr, serve_rendezvous=serve, source=src.name, assumed=assumed)


def from_env(env: Optional[Mapping[str, str]] = None) -> Topology:
    """Build the ``Topology`` of this process from ``env`` (default ``os.environ``).

    Sources are tried in the order of ``SOURCES`` (``SDP``, ``HOROVOD``, ``OMPI``, ``PMI``,
    ``SLURM``, ``SAGEMAKER``, ``TF_CONFIG``, ``TORCHRUN``, ``INDEXED_JOB``, ``default``); the
    first whose rank and size variables are present wins.  See the module docstring for the variables and for how missing values
    (local, cross, rendezvous) are filled in.

    Raises ``TopologyError`` for non-integer or inconsistent values, and
    when a world of size > 1 has no rendezvous address.
    """
    env = os.environ if env is None else env
    if "SDP_RANK" in env and "SDP_SIZE" in env:
        return Topology(
            rank=_int(env, "SDP_RANK"), size=_int(env, "SDP_SIZE"),
            local_rank=_int(env, "SDP_LOCAL_RANK") if "SDP_LOCAL_RANK" in env else 0,
            local_size=_int(env, "SDP_LOCAL_SIZE") if "SDP_LOCAL_SIZE" in env else 1,
            cross_rank=_int(env, "SDP_CROSS_RANK") if "SDP_CROSS_RANK" in env else 0,
            cross_size=_int(env, "SDP_CROSS_SIZE") if "SDP_CROSS_SIZE" in env else 1,
            hostname=env.get("SDP_HOSTNAME") or socket.gethostname(),
            rendezvous_addr=env.get("SDP_RENDEZVOUS_ADDR"),
            serve_rendezvous=False, source="SDP")
    for src in _SOURCES:
        raw = src.raw(env)
        if raw is not None:
            return _from_source(env, src, raw)
    return Topology(source="default")

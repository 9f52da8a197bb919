"""``RayExecutor``: sdp ranks as Ray actors (mirrors ``horovod.ray.RayExecutor``).

::

    import ray, sdp
    from sdp.ray import RayExecutor

    ray.init(address="auto")
    settings = RayExecutor.create_settings(timeout_s=30)
    executor = RayExecutor(settings, num_workers=4, cpus_per_worker=1, use_gpu=False)
    executor.start()

    def train(epochs):
        sdp.init()
        ...
        return sdp.rank()

    print(executor.run(train, args=[2]))   # [0, 1, 2, 3]: one result per rank, in rank order
    executor.shutdown()

:meth:`RayExecutor.start` reserves one bundle per rank (``{"CPU": cpus_per_worker}``, plus
``{"GPU": gpus_per_worker}`` with ``use_gpu``) in a placement group (strategy ``PACK``, as
Horovod's), waits ``placement_group_timeout_s`` seconds for it, starts one actor per bundle,
numbers the ranks node by node (so the ranks of one Ray node are consecutive, as ``-H`` does) and
gives every actor the ``SDP_*`` variables ``sdprun`` would: rank, size, local and cross rank and
size (from the actors' Ray node ids), ``SDP_HOSTNAME`` (the node id), ``SDP_RENDEZVOUS_ADDR``
(a rendezvous server the executor serves on the driver's Ray node address, never ``0.0.0.0``),
``SDP_JOB_ID``, ``SDP_START_TIMEOUT`` (``timeout_s``) and ``SDP_SECRET`` (a new job secret, sent
to the actors as a Ray call argument: Ray's own channels carry it, encrypted only where Ray's TLS
is on).  ``sdp.init()`` in the function then forms the job.

When the driver has ``sdp.compat`` families installed (``sdp.compat.install("horovod")``, or
``SDP_COMPAT`` with sdp's shim directory on ``PYTHONPATH``), every actor installs them too, so
functions written for Horovod (``import horovod.tensorflow as hvd; hvd.init()``) run unchanged.

A rank that dies (its actor killed or lost) makes the others raise
:class:`~sdp.common.errors.PeerLostError` from their next collective, so ``run`` raises.
"""
import dataclasses
import os
import secrets
import socket
from typing import Any, Callable, Dict, List, Optional

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from sdp.launcher import hosts as hostlib
from sdp.transport import security


@dataclasses.dataclass
class RaySettings:
    """What ``RayExecutor.create_settings`` returns (Horovod's ``MiniSettings`` fields).

    ``timeout_s``: seconds the ranks may take to reach rendezvous; ``placement_group_timeout_s``:
    seconds to wait for the placement group; ``nics``: interfaces for sdp's traffic (the first
    becomes ``SDP_IFACE``); ``ssh_identity_file`` is accepted and unused (Ray starts the
    processes)."""
    timeout_s: float = 30
    placement_group_timeout_s: float = 100
    nics: Optional[set] = None
    ssh_identity_file: Optional[str] = None


class _Worker:
    """The actor of one rank: holds its environment and runs functions in its process."""

    def __init__(self, executable_cls=None, args=None, kwargs=None, extra_env=None, compat=()):
        os.environ.update(extra_env or {})
        if compat:  # the driver's sdp.compat families (import horovod.tensorflow in the functions)
            from sdp.compat import install
            install(compat)
        self.executable = executable_cls(*(args or []), **(kwargs or {})) if executable_cls else None

    def node(self):
        return ray.get_runtime_context().get_node_id(), socket.gethostname()

    def update_env_vars(self, env: Dict[str, str]) -> None:
        os.environ.update(env)

    def env_vars(self) -> Dict[str, str]:
        return dict(os.environ)

    def execute(self, fn):
        return fn(self.executable)

    def run(self, fn, args, kwargs):
        return fn(*args, **kwargs)


class RayExecutor:
    """Run a function on ``num_workers`` sdp ranks, one Ray actor each (``horovod.ray.RayExecutor``).

    ``settings``: from :meth:`create_settings`.  ``num_workers``: number of ranks (or
    ``num_hosts`` x ``num_workers_per_host``); ``cpus_per_worker`` / ``gpus_per_worker`` (default
    1 with ``use_gpu``): Ray resources each rank reserves.  Raises ``ValueError`` for a bad count.
    """

    @classmethod
    def create_settings(cls, timeout_s: float = 30, ssh_identity_file: Optional[str] = None,
                        ssh_str: Optional[str] = None, placement_group_timeout_s: float = 100,
                        nics: Optional[set] = None) -> RaySettings:
        """Settings of an executor (Horovod's signature; ``ssh_*`` are accepted and unused)."""
        return RaySettings(timeout_s=timeout_s, placement_group_timeout_s=placement_group_timeout_s,
                           nics=nics, ssh_identity_file=ssh_identity_file)

    def __init__(self, settings: RaySettings, num_workers: Optional[int] = None,
                 num_hosts: Optional[int] = None, num_workers_per_host: int = 1,
                 cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: Optional[float] = None):
        if num_workers is None and num_hosts is not None:
            num_workers = num_hosts * num_workers_per_host
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
        self.settings = settings
        self.num_workers = num_workers
        self.strategy = "STRICT_SPREAD" if num_hosts and num_workers_per_host == 1 else "PACK"
        self.bundle = {"CPU": cpus_per_worker}
        if use_gpu or gpus_per_worker:
            self.bundle["GPU"] = gpus_per_worker or 1
        self.workers: List[Any] = []  # actor handles, in rank order
        self._pg = None
        self._server = None

    # ------------------------------------------------------------------ start / shutdown
    def start(self, executable_cls: Optional[type] = None, executable_args: Optional[List] = None,
              executable_kwargs: Optional[Dict] = None, extra_env_vars: Optional[Dict] = None) -> None:
        """Reserve the placement group, start the actors and give them their ranks.  Raises
        ``TimeoutError`` when the placement group is not ready within
        ``placement_group_timeout_s`` (the cluster lacks the resources)."""
        from sdp.transport.rendezvous import RendezvousServer

        self._pg = placement_group([dict(self.bundle) for _ in range(self.num_workers)],
                                   strategy=self.strategy)
        ready, _ = ray.wait([self._pg.ready()], timeout=self.settings.placement_group_timeout_s)
        if not ready:
            self.shutdown()
            raise TimeoutError(f"Ray could not place {self.num_workers} workers of {self.bundle} "
                               f"within {self.settings.placement_group_timeout_s:g} s")
        from sdp.compat import installed
        actor = ray.remote(_Worker)
        started = [actor.options(num_cpus=self.bundle["CPU"], num_gpus=self.bundle.get("GPU", 0),
                                 scheduling_strategy=PlacementGroupSchedulingStrategy(
                                     self._pg, placement_group_bundle_index=i))
                   .remote(executable_cls, executable_args, executable_kwargs, extra_env_vars, installed())
                   for i in range(self.num_workers)]
        nodes = ray.get([w.node.remote() for w in started])
        # ranks node by node, in the order the nodes first appear among the bundles
        order = list(dict.fromkeys(node for node, _ in nodes))
        by_rank = sorted(range(len(started)), key=lambda i: order.index(nodes[i][0]))
        self.workers = [started[i] for i in by_rank]
        infos = hostlib.assign_ranks([hostlib.HostSlots(n, sum(1 for m, _ in nodes if m == n)) for n in order],
                                     self.num_workers)
        secret = security.new_secret()
        self._server = RendezvousServer(size=self.num_workers, host=ray.util.get_node_ip_address(), port=0,
                                        timeout_s=self.settings.timeout_s, secret=secret).start()
        common = {"SDP_RENDEZVOUS_ADDR": self._server.address, "SDP_JOB_ID": secrets.token_hex(8),
                  "SDP_START_TIMEOUT": f"{self.settings.timeout_s:g}", security.SECRET_ENV: secret}
        if self.settings.nics:
            common["SDP_IFACE"] = sorted(self.settings.nics)[0]
        ray.get([w.update_env_vars.remote(dict(common, **info.env()))
                 for w, info in zip(self.workers, infos)])

    def shutdown(self) -> None:
        """Kill the actors, release the placement group, stop the rendezvous server.  Idempotent."""
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
        if self._server is not None:
            self._server.stop()
            self._server = None

    # ------------------------------------------------------------------ running
    def _check_started(self) -> None:
        if not self.workers:
            raise RuntimeError("RayExecutor.start() has not been called (or shutdown() was)")

    def run_remote(self, fn: Callable, args: Optional[List] = None,
                   kwargs: Optional[Dict] = None) -> List["ray.ObjectRef"]:
        """Start ``fn(*args, **kwargs)`` on every rank; return one ``ObjectRef`` per rank, in
        rank order (``ray.get`` them)."""
        self._check_started()
        return [w.run.remote(fn, list(args or []), dict(kwargs or {})) for w in self.workers]

    def run(self, fn: Callable, args: Optional[List] = None, kwargs: Optional[Dict] = None,
            callbacks: Optional[List[Callable]] = None) -> List[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order.  Raises what a rank
        raised (``ray.exceptions.RayTaskError`` wrapping it, ``RayActorError`` for a dead actor).
        ``callbacks`` is accepted for Horovod's signature and unused."""
        return ray.get(self.run_remote(fn, args, kwargs))

    def execute(self, fn: Callable[[Any], Any], callbacks: Optional[List[Callable]] = None) -> List[Any]:
        """``fn(executable)`` on every rank (``executable``: the ``executable_cls`` instance given
        to :meth:`start`, else None); the results in rank order."""
        self._check_started()
        return ray.get([w.execute.remote(fn) for w in self.workers])

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0 only."""
        self._check_started()
        return ray.get(self.workers[0].execute.remote(fn))

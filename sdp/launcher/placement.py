"""Where workers run and how they start there: rank tables from host names, and the
:class:`~sdp.launcher.base.Launcher` of each host (this machine directly, others through ssh).

Used by every way ``sdprun`` places workers: a static job (``-H``/``--hostfile``), KungFu's
``-w`` (ranks fill the ``-H`` hosts in order, :func:`sdp.launcher.hosts.assign_ranks`) and
Horovod Elastic (each epoch's members in rank order, wherever they run: :func:`rank_infos`).
"""
from typing import Dict, List, Sequence

from sdp.launcher import hosts as hostlib
from sdp.launcher.base import Launcher
from sdp.launcher.local import LocalLauncher
from sdp.launcher.ssh import SshLauncher, SshOptions


def rank_infos(hostnames: Sequence[str]) -> List[hostlib.RankInfo]:
    """The :class:`~sdp.launcher.hosts.RankInfo` of each rank when rank ``r`` runs on
    ``hostnames[r]`` (ranks of one host need not be consecutive): ``local_rank`` counts the
    ranks of the same host in rank order; ``cross_rank`` is the host's index among the hosts
    (in order of first appearance) that have that ``local_rank``."""
    order = list(dict.fromkeys(hostnames))
    of_host: Dict[str, List[int]] = {}
    for r, h in enumerate(hostnames):
        of_host.setdefault(h, []).append(r)
    out = []
    for r, h in enumerate(hostnames):
        same = of_host[h]
        lr = same.index(r)
        having = [x for x in order if len(of_host[x]) > lr]
        out.append(hostlib.RankInfo(r, len(hostnames), lr, len(same), having.index(h), len(having), h))
    return out


class Launchers:
    """``launcher_of(host)`` for :class:`~sdp.launcher.procs.WorkerGroup`: a
    :class:`~sdp.launcher.local.LocalLauncher` for this machine (every host in fake-hosts mode,
    ``SDP_LAUNCHER_ALLOW_FAKE_HOSTS=1``), one :class:`~sdp.launcher.ssh.SshLauncher` per other
    host, made when a worker first goes there (elastic jobs meet hosts as they run).
    ``forward``: extra variable names remote ranks get (``-x NAME``); ``grace_s``: the remote
    side's SIGTERM-to-SIGKILL wait."""

    def __init__(self, options: SshOptions = SshOptions(), forward: Sequence[str] = (),
                 grace_s: float = 3.0, allow_fake: bool = False):
        self.options = options
        self.forward = tuple(forward)
        self.grace_s = grace_s
        self.allow_fake = allow_fake
        self.local = LocalLauncher()
        self._names = hostlib.local_names()
        self._ssh: Dict[str, SshLauncher] = {}

    def is_remote(self, host: str) -> bool:
        """Whether workers on ``host`` start through ssh (not for ``""``: a worker that is one
        ``mpirun``/``srun`` command)."""
        return bool(host) and not self.allow_fake and not hostlib.is_local(host, self._names)

    def __call__(self, host: str) -> Launcher:
        if not self.is_remote(host):
            return self.local
        if host not in self._ssh:
            self._ssh[host] = SshLauncher(host, self.options, forward=self.forward, grace_s=self.grace_s)
        return self._ssh[host]

"""A real Slurm cluster on emulated hosts (tests/emulated_hosts.py) for tests/test_slurm.py.

``SlurmCluster(hosts, ["h1", "h2"]).up()`` starts, all with throwaway files in one temporary
directory (nothing under ``/etc`` is touched):

* one ``munged`` (its own key, socket, pid, log and seed files; its Unix socket is reached from
  every host, which share the file system);
* ``slurmctld`` on the first host (``SlurmctldHost``), one ``slurmd -N hN`` on each host, each in
  that host's network namespace with its hostname, configured by one ``slurm.conf``
  (``auth/munge`` through that socket, ``proctrack/linuxproc``, no cgroups, ``CPUs=2`` per node
  with ``SlurmdParameters=config_overrides``, one partition ``emu``);

and waits until ``sinfo`` shows every node idle.  :meth:`SlurmCluster.argv` runs a Slurm client
command (``srun``, ``sbatch``, ``squeue``, ``scancel``) on a host with ``SLURM_CONF`` set.
:meth:`down` stops every daemon and removes the directory.  Needs Debian's ``slurm-wlm`` and
``munge``: :func:`unavailable_reason` says what is missing.
"""
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import emulated_hosts

DAEMONS = ("slurmctld", "slurmd", "munged", "srun", "sbatch", "sinfo", "scancel")
PARTITION = "emu"
CPUS_PER_NODE = 2


def unavailable_reason() -> Optional[str]:
    """Why a Slurm cluster cannot be started here, or None when it can."""
    missing = [d for d in DAEMONS if shutil.which(d) is None and not os.access(f"/usr/sbin/{d}", os.X_OK)]
    if missing:
        return f"Slurm tests need {', '.join(missing)} (apt-get install slurm-wlm munge)"
    return None


def _which(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmUnavailable(RuntimeError):
    """The daemons did not start or the nodes did not come up."""


class SlurmCluster:
    """slurmctld + one slurmd per host of ``nodes`` on the emulated ``hosts``."""

    def __init__(self, hosts, nodes: Sequence[str]):
        self.hosts = hosts
        self.nodes = list(nodes)
        self.dir: Optional[str] = None
        self.procs: Dict[str, subprocess.Popen] = {}

    @property
    def conf(self) -> str:
        return os.path.join(self.dir, "slurm.conf")

    def env(self, base: Optional[dict] = None, **extra) -> dict:
        """``base`` (default ``os.environ``) with ``SLURM_CONF`` and ``extra``; Slurm variables of
        an enclosing job removed."""
        env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = self.conf
        env.update(extra)
        return env

    def argv(self, host: str, argv: Sequence[str]) -> List[str]:
        """Run ``argv`` on ``host`` (its network namespace, hostname and ``/etc/hosts``)."""
        return self.hosts.argv(host, argv)

    def daemon_argv(self, host: str, argv: Sequence[str]) -> List[str]:
        """Like :meth:`argv`, but keeping this machine's ``/sys`` (``ip netns exec`` mounts a
        fresh sysfs, hiding ``/sys/fs/cgroup``, without which slurmd does not start)."""
        hosts_file = os.path.join(emulated_hosts.NETNS_ETC, self.hosts.netns(host), "hosts")
        return ["nsenter", f"--net=/run/netns/{self.hosts.netns(host)}", "unshare", "--uts", "--mount",
                "sh", "-c", f"hostname {host} && mount --bind {shlex.quote(hosts_file)} /etc/hosts && "
                            f"exec {shlex.join(argv)}"]

    # ------------------------------------------------------------------ up / down
    def up(self, timeout_s: float = 60.0) -> "SlurmCluster":
        self.dir = tempfile.mkdtemp(prefix="sdpt-slurm-")
        os.chmod(self.dir, 0o755)  # munged checks that its directories are not writable by others
        try:
            self._munge()
            self._config()
            ctl = self.nodes[0]
            self._start("slurmctld", ctl, [_which("slurmctld"), "-D", "-f", self.conf])
            for node in self.nodes:
                self._start(f"slurmd-{node}", node, [_which("slurmd"), "-D", "-f", self.conf, "-N", node])
            self._wait_idle(timeout_s)
        except BaseException:
            self.down()
            raise
        return self

    def _munge(self) -> None:
        d = self.dir
        key = os.path.join(d, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self.munge_socket = os.path.join(d, "munge.socket")
        res = subprocess.run([_which("munged"), "--force", f"--socket={self.munge_socket}",
                              f"--key-file={key}", f"--pid-file={d}/munged.pid",
                              f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"],
                             capture_output=True, text=True, timeout=30)
        if res.returncode != 0:
            raise SlurmUnavailable(f"munged did not start: {res.stderr.strip()}")

    def _config(self) -> None:
        d = self.dir
        ctl = self.nodes[0]
        nodes = "\n".join(f"NodeName={n} NodeAddr={self.hosts.address(n)} CPUs={CPUS_PER_NODE} State=UNKNOWN"
                          for n in self.nodes)
        for sub in ["state"] + [f"spool/{n}" for n in self.nodes]:
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=sdpt
SlurmctldHost={ctl}({self.hosts.address(ctl)})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
SlurmdTimeout=30
KillWait=3
InactiveLimit=0
{nodes}
PartitionName={PARTITION} Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")

    def _start(self, name: str, host: str, argv: List[str]) -> None:
        log = open(os.path.join(self.dir, f"{name}.out"), "w")
        self.procs[name] = subprocess.Popen(self.daemon_argv(host, argv), stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, env=self.env())
        log.close()

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited ({p.returncode}): {self.log(name)[-2000:]}")
            res = subprocess.run(self.argv(self.nodes[0], ["sinfo", "-h", "-N", "-o", "%N %t"]),
                                 capture_output=True, text=True, env=self.env(), timeout=30)
            states = dict(line.split() for line in res.stdout.splitlines() if len(line.split()) == 2)
            if all(states.get(n) == "idle" for n in self.nodes):
                return
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"nodes not idle after {timeout_s:g} s: {states or res.stderr.strip()}; "
                                       f"slurmctld log: {self.log('slurmctld')[-2000:]}")
            time.sleep(0.5)

    def log(self, name: str) -> str:
        """The output of daemon ``name`` (``slurmctld``, ``slurmd-h1``, ...) so far."""
        try:
            with open(os.path.join(self.dir, f"{name}.out"), errors="replace") as f:
                return f.read()
        except (OSError, TypeError):
            return ""

    def down(self) -> None:
        """Stop the daemons (SIGTERM, SIGKILL after 5 s) and munged; remove the directory."""
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=5)
        self.procs.clear()
        if self.dir:
            try:
                with open(os.path.join(self.dir, "munged.pid")) as f:
                    os.kill(int(f.read().strip()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

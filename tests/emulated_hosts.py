"""Emulated hosts for multi-host tests: network namespaces with their own hostname and sshd.

``EmulatedHosts(3).up()`` makes hosts ``h1``, ``h2``, ``h3``:

* network namespace ``sdpt-hN`` with interface ``eth0`` = ``10.77.0.N/24``, a veth pair whose
  other end ``sdpt-hN-v`` is a port of bridge ``sdpt-br0`` (``10.77.0.254``) in the root namespace;
* its own hostname (a UTS namespace made by ``unshare --uts``) and its own ``sshd`` listening on
  ``10.77.0.N:22``: root logs in with a throwaway key only; host and user keys, sshd configs,
  ``known_hosts`` and logs live in a temporary directory;
* optionally (``rate``, e.g. ``"2gbit"``) a rate limit on each host's link, both directions: a
  ``tbf`` qdisc (token bucket, ``tc``'s rate syntax) on ``eth0`` inside the host (what it sends)
  and on ``sdpt-hN-v`` (what it receives).  Unshaped, a veth "link" is the kernel copying bytes
  on the same cores as the ranks; shaped below that speed, the link is the bottleneck, as a NIC
  is between real hosts with cores of their own;
* ``/etc/netns/sdpt-hN/hosts`` (all hosts' names) and ``/etc/netns/sdpt-hN/ssh/ssh_config``
  (the throwaway key, ``known_hosts`` in the temporary directory, ``accept-new``): ``ip netns
  exec`` bind-mounts them over ``/etc/hosts`` and ``/etc/ssh``, so ``ssh h2`` works inside
  every host without touching the real ``/etc``.

The file system is shared, so the checkout and its virtual environment are at the same path on
every host (as on a cluster with a shared home).  ``/dev/shm`` is shared too (sdp tells hosts
apart by ``SDP_HOSTNAME``, not by the files).

Run a command on a host with :meth:`EmulatedHosts.argv` (``ip netns exec sdpt-hN unshare --uts
sh -c 'hostname hN; exec ...'``) or through ssh from another host.  :meth:`down` kills every
process in the namespaces and removes namespaces, bridge, ``/etc/netns`` entries and the
temporary directory; it is also what ``python tests/emulated_hosts.py down`` does, and it
cleans up leftovers of an earlier run before ``up``.

Needs root, ``ip`` (iproute2), ``unshare``, ``sshd`` / ``ssh`` / ``ssh-keygen`` (OpenSSH):
:func:`unavailable_reason` says what is missing (tests skip with it).

As a script::

    python tests/emulated_hosts.py up 3     # prints the hosts and how to use them
    python tests/emulated_hosts.py up 2 --rate 2gbit   # links shaped to 2 Gbit/s each way
    python tests/emulated_hosts.py down
"""
import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

PREFIX = "sdpt"
SUBNET = "10.77.0"
BRIDGE = f"{PREFIX}-br0"
BRIDGE_ADDR = f"{SUBNET}.254"
STATE_FILE = f"/run/{PREFIX}-emulated-hosts.json"  # where `down` finds the temporary directory
NETNS_ETC = "/etc/netns"
TOOLS = ("ip", "unshare", "ssh", "ssh-keygen")
RATE_ENV = "SDPT_LINK_RATE"  # the test fixtures' hosts get links shaped to this rate (tc syntax), if set
TBF_BURST = "1mb"  # token bucket depth: >= one 64 KB GSO packet, ~1-8 ms of traffic at 1-10 Gbit/s
TBF_LATENCY = "20ms"  # longest a packet may wait in the shaper's queue (sets its length)
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


class HostsUnavailable(RuntimeError):
    """This machine cannot make emulated hosts (not root, a tool missing, namespaces refused)."""


def unavailable_reason() -> Optional[str]:
    """Why emulated hosts cannot be made here, or None when they can."""
    if not sys.platform.startswith("linux"):
        return "emulated hosts need Linux network namespaces"
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces, sshd)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if not os.access(SSHD, os.X_OK):
        missing.append("sshd")
    if missing:
        return f"emulated hosts need {', '.join(missing)} (apt-get install openssh-server iproute2)"
    return None


def _run(argv: Sequence[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise HostsUnavailable(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


class EmulatedHosts:
    """``n`` emulated hosts ``h1..hn`` (see the module docstring)."""

    def __init__(self, n: int, prefix: str = PREFIX, subnet: str = SUBNET, rate: Optional[str] = None):
        """``rate``: None (unshaped) or each link's rate in each direction, in ``tc``'s syntax
        (``"2gbit"``, ``"500mbit"``); see the module docstring."""
        if not 1 <= n <= 250:
            raise ValueError(f"between 1 and 250 hosts, not {n}")
        self.n = n
        self.rate = rate or None
        self.prefix = prefix
        self.subnet = subnet
        self.bridge = f"{prefix}-br0"
        self.names = [f"h{i}" for i in range(1, n + 1)]
        self.dir: Optional[str] = None
        self.sshd: Dict[str, subprocess.Popen] = {}

    # ------------------------------------------------------------------ names and commands
    def netns(self, host: str) -> str:
        """The network namespace of ``host``: ``sdpt-hN``."""
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        """``host``'s IPv4 address, ``10.77.0.N``."""
        return f"{self.subnet}.{self.names.index(host) + 1}"

    def argv(self, host: str, argv: Sequence[str]) -> List[str]:
        """The command line running ``argv`` on ``host``: in its namespace, with its hostname."""
        return ["ip", "netns", "exec", self.netns(host), "unshare", "--uts", "sh", "-c",
                f"hostname {host} && exec {shlex.join(argv)}"]

    def run(self, host: str, argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
        """``subprocess.run`` of ``argv`` on ``host`` (text output captured unless given)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.argv(host, argv), **kw)

    def popen(self, host: str, argv: Sequence[str], **kw) -> subprocess.Popen:
        """``subprocess.Popen`` of ``argv`` on ``host``."""
        return subprocess.Popen(self.argv(host, argv), **kw)

    def ssh_config_path(self) -> str:
        return os.path.join(self.dir, "ssh_config")

    def hostfile(self, slots: Dict[str, int]) -> str:
        """Write a Horovod hostfile (``host slots=N`` lines) into the temporary directory."""
        path = os.path.join(self.dir, "hostfile-" + "-".join(f"{h}{n}" for h, n in slots.items()))
        with open(path, "w") as f:
            f.writelines(f"{h} slots={n}\n" for h, n in slots.items())
        return path

    # ------------------------------------------------------------------ processes on a host
    def pids(self, host: str) -> List[int]:
        """Processes in ``host``'s network namespace, its sshd listener excluded."""
        res = _run(["ip", "netns", "pids", self.netns(host)], check=False)
        sshd = self.sshd.get(host)
        skip = {sshd.pid} if sshd is not None else set()
        return [int(p) for p in res.stdout.split() if p.strip().isdigit() and int(p) not in skip
                and not _is_zombie(int(p))]

    def processes(self, host: str) -> Dict[int, str]:
        """``{pid: command line}`` of :meth:`pids` (processes that vanished meanwhile left out)."""
        out = {}
        for pid in self.pids(host):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    out[pid] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                pass
        return out

    def wait_no_processes(self, host: str, match: str = "", timeout_s: float = 10.0) -> Dict[int, str]:
        """Wait until no process whose command line contains ``match`` runs on ``host`` (sshd's
        own listener excluded); return what is still there after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = {p: c for p, c in self.processes(host).items() if match in c}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def set_aliases(self, aliases: Dict[str, List[str]]) -> None:
        """Make every host resolve the names ``aliases[host]`` to ``host``'s address (as a
        cluster's DNS would: a headless Service's pod names, SageMaker's ``algo-N``), by
        rewriting ``/etc/netns/NS/hosts``; ``{}`` removes them again."""
        lines = ["127.0.0.1 localhost"] + [
            " ".join([self.address(h), h] + list(aliases.get(h, ()))) for h in self.names]
        for h in self.names:
            with open(os.path.join(NETNS_ETC, self.netns(h), "hosts"), "w") as f:
                f.write("\n".join(lines) + "\n")

    def link(self, host: str, up: bool) -> None:
        """Cut (``up=False``) or restore ``host``'s link to the bridge (``ip link set ... down``)."""
        _run(["ip", "-n", self.netns(host), "link", "set", "eth0", "up" if up else "down"])

    # ------------------------------------------------------------------ up / down
    def up(self) -> "EmulatedHosts":
        """Make the hosts and start their sshds.  Raises :class:`HostsUnavailable`."""
        reason = unavailable_reason()
        if reason:
            raise HostsUnavailable(reason)
        down(self.prefix)  # leftovers of an earlier run
        self.dir = tempfile.mkdtemp(prefix=f"{self.prefix}-hosts-")
        with open(STATE_FILE if self.prefix == PREFIX else f"/run/{self.prefix}-emulated-hosts.json", "w") as f:
            json.dump({"dir": self.dir, "names": self.names}, f)
        try:
            self._network()
            self._keys_and_configs()
            for h in self.names:
                self._start_sshd(h)
            self._wait_ssh()
        except BaseException:
            self.down()
            raise
        return self

    def _network(self) -> None:
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.subnet}.254/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for h in self.names:
            ns, veth = self.netns(h), f"{self.prefix}-{h}-v"
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(["ip", "link", "set", veth, "master", self.bridge, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(h)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            if self.rate:
                self._shape(["ip", "netns", "exec", ns], "eth0")  # host -> bridge
                self._shape([], veth)  # bridge -> host

    def _shape(self, where: List[str], dev: str) -> None:
        if shutil.which("tc") is None:
            raise HostsUnavailable("a link rate needs tc (apt-get install iproute2)")
        _run(where + ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", self.rate,
                      "burst", TBF_BURST, "latency", TBF_LATENCY])

    def _keys_and_configs(self) -> None:
        d = self.dir
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "sdpt-user", "-f", f"{d}/id_ed25519"])
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "sdpt-host", "-f", f"{d}/host_key"])
        shutil.copy(f"{d}/id_ed25519.pub", f"{d}/authorized_keys")
        os.chmod(d, 0o700)
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        hosts = "127.0.0.1 localhost\n" + "".join(f"{self.address(h)} {h}\n" for h in self.names)
        with open(self.ssh_config_path(), "w") as f:
            f.write(f"Host *\n  IdentityFile {d}/id_ed25519\n  UserKnownHostsFile {d}/known_hosts\n"
                    f"  StrictHostKeyChecking accept-new\n  User root\n  LogLevel ERROR\n")
        for h in self.names:
            etc = os.path.join(NETNS_ETC, self.netns(h))
            os.makedirs(os.path.join(etc, "ssh"), exist_ok=True)
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write(hosts)
            shutil.copy(self.ssh_config_path(), os.path.join(etc, "ssh", "ssh_config"))
            with open(f"{d}/sshd_{h}.conf", "w") as f:
                f.write(f"ListenAddress {self.address(h)}\nPort 22\nHostKey {d}/host_key\n"
                        f"PermitRootLogin prohibit-password\nPubkeyAuthentication yes\n"
                        f"PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                        f"AuthorizedKeysFile {d}/authorized_keys\nStrictModes no\n"
                        f"PidFile {d}/sshd_{h}.pid\nClientAliveInterval 5\nClientAliveCountMax 3\n"
                        f"MaxStartups 100\nMaxSessions 100\nLogLevel ERROR\n")

    def _start_sshd(self, h: str) -> None:
        log = open(f"{self.dir}/sshd_{h}.log", "w")
        self.sshd[h] = subprocess.Popen(
            self.argv(h, [SSHD, "-D", "-e", "-f", f"{self.dir}/sshd_{h}.conf"]),
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def _wait_ssh(self, timeout_s: float = 20.0) -> None:
        """Wait until every host reaches every host over ssh (first host: all of them)."""
        deadline = time.monotonic() + timeout_s
        first = self.names[0]
        for h in self.names:
            while True:
                if self.sshd[h].poll() is not None:
                    raise HostsUnavailable(f"sshd on {h} exited: {open(f'{self.dir}/sshd_{h}.log').read()}")
                res = self.run(first, ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=2", h,
                                       "hostname"], timeout=10)
                if res.returncode == 0 and res.stdout.strip() == h:
                    break
                if time.monotonic() > deadline:
                    raise HostsUnavailable(f"ssh {first} -> {h} does not work: {res.stderr.strip()}")
                time.sleep(0.2)

    def down(self) -> None:
        """Kill every process of the hosts, remove namespaces, bridge, /etc/netns entries and
        the temporary directory.  Idempotent."""
        down(self.prefix, self.names)
        self.sshd.clear()
        self.dir = None

    def __enter__(self) -> "EmulatedHosts":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return True


def down(prefix: str = PREFIX, names: Optional[List[str]] = None) -> None:
    """Remove the emulated hosts of ``prefix`` (all namespaces ``PREFIX-*``), whatever state
    they are in."""
    state_file = STATE_FILE if prefix == PREFIX else f"/run/{prefix}-emulated-hosts.json"
    state = {}
    try:
        with open(state_file) as f:
            state = json.load(f)
    except (OSError, ValueError):
        pass
    listed = _run(["ip", "netns", "list"], check=False).stdout.split("\n")
    namespaces = {line.split()[0] for line in listed if line.startswith(f"{prefix}-")}
    namespaces |= {f"{prefix}-{h}" for h in (names or []) + state.get("names", [])}
    for _ in range(3):  # processes may fork while we kill them
        pids = set()
        for ns in namespaces:
            pids |= {int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split()
                     if p.isdigit()}
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    # veth ends in the root namespace first: a deleted namespace takes its peers down only later
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if line.count(":") >= 2 else ""
        if name.startswith(f"{prefix}-") and name.endswith("-v"):
            _run(["ip", "link", "del", name], check=False)
    for ns in namespaces:
        _run(["ip", "netns", "del", ns], check=False)
        shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)
    _run(["ip", "link", "del", f"{prefix}-br0"], check=False)
    if state.get("dir", "").startswith(tempfile.gettempdir()):
        shutil.rmtree(state["dir"], ignore_errors=True)
    try:
        os.unlink(state_file)
    except OSError:
        pass


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="python tests/emulated_hosts.py", description="make or remove emulated hosts")
    p.add_argument("action", choices=("up", "down"))
    p.add_argument("n", type=int, nargs="?", default=2, help="hosts (up; default 2)")
    p.add_argument("--rate", default=os.environ.get(RATE_ENV),
                   help=f"shape each host's link to this rate each way, tc syntax (2gbit, 500mbit); "
                        f"default ${RATE_ENV} or unshaped")
    args = p.parse_args(argv)
    if args.action == "up":
        hosts = EmulatedHosts(args.n, rate=args.rate).up()
        for proc in hosts.sshd.values():  # they outlive this script
            proc.returncode = 0
        print(f"hosts {', '.join(f'{h}={hosts.address(h)}' for h in hosts.names)}; files in {hosts.dir}; "
              f"links {'shaped to ' + hosts.rate + ' each way' if hosts.rate else 'unshaped'}")
        print(f"run on h1: ip netns exec {hosts.netns('h1')} unshare --uts sh -c 'hostname h1; exec bash'")
        print(f"then e.g.: sdprun -np 4 -H h1:2,h2:2 python examples/tf2_mnist.py")
        print("remove:   python tests/emulated_hosts.py down")
        return 0
    down()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

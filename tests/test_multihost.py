"""``sdprun`` across emulated hosts (tests/emulated_hosts.py): real sshd, real ssh, real sockets.

Three hosts ``h1``, ``h2``, ``h3`` (network namespaces on a bridge, 10.77.0.0/24, each with its
own hostname and sshd) are made once per session by the ``hosts`` fixture of tests/conftest.py;
``sdprun`` always runs on ``h1`` and reaches the others through ssh.  Skipped where namespaces cannot be made (not root, no iproute2/OpenSSH).
"""
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import emulated_hosts  # noqa: E402
import replay  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MNIST_DIR = os.environ.get("SDP_MNIST_DIR", os.path.join(os.path.dirname(REPO), "shared", "data", "mnist"))

pytestmark = pytest.mark.skipif(emulated_hosts.unavailable_reason() is not None,
                                reason=str(emulated_hosts.unavailable_reason()))


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("SDP_LAUNCHER_ALLOW_FAKE_HOSTS", None)
    env.pop("SDP_SECRET", None)
    env.pop("SDP_IFACE", None)
    env.update(extra)
    return env


def _sdprun_argv(*args):
    return [sys.executable, "-m", "sdp.launcher.cli", *args]


def sdprun(hosts, *args, timeout=120, env=None, cwd=REPO):
    """Run sdprun on h1 and wait for it."""
    return hosts.run("h1", _sdprun_argv(*args), timeout=timeout, env=env or _env(), cwd=cwd)


def _by_rank(text, tag="stdout"):
    rows = {}
    for line in text.splitlines():
        m = re.match(rf"\[(\d+)\]<{tag}>:(.*)", line)
        if m:
            rows.setdefault(int(m.group(1)), []).append(m.group(2))
    return rows


def _no_job_left(hosts, job, marker, wait_s=10.0):
    """No process whose command line holds ``marker`` on any host, no /dev/shm file or ipc
    directory of ``job`` (the file system is shared between the emulated hosts)."""
    import tempfile
    for h in hosts.names:
        left = hosts.wait_no_processes(h, match=marker, timeout_s=wait_s)
        assert not left, f"processes left on {h}: {left}"
    assert not glob.glob(f"/dev/shm/sdp-{job}-*"), glob.glob(f"/dev/shm/sdp-{job}-*")
    ipc = glob.glob(os.path.join(tempfile.gettempdir(), f"sdp-{job}-*"))
    assert not ipc, ipc  # issue 25 item 5: were left after every abnormal end


# ---------------------------------------------------------------- launch, environment, --check

ENV_PROBE = r"""
import json, os, socket, sys
secret = os.environ.get('SDP_SECRET', '')
in_argv = []
for pid in os.listdir('/proc'):
    try:
        if pid.isdigit() and secret and secret.encode() in open(f'/proc/{pid}/cmdline', 'rb').read():
            in_argv.append(pid)
    except OSError:
        pass
keys = ['SDP_RANK', 'SDP_LOCAL_RANK', 'SDP_LOCAL_SIZE', 'SDP_CROSS_RANK', 'SDP_CROSS_SIZE',
        'SDP_HOSTNAME', 'SDP_RENDEZVOUS_ADDR', 'SDP_TEST_FORWARD', 'HOROVOD_TEST_FORWARD',
        'TF_TEST_FORWARD', 'SDPT_EXPORTED', 'SDPT_SET', 'SDPT_NOT_FORWARDED', 'PYTHONPATH']
print(json.dumps(dict({k: os.environ.get(k) for k in keys}, host=socket.gethostname(), cwd=os.getcwd(),
                      secret=secret, secret_in_argv=in_argv)))
"""


def test_remote_ranks_get_environment_cwd_and_secret(hosts, tmp_path):
    """-H h1:1,h2:2 on h1: rank 0 local, ranks 1-2 through ssh; SDP_*/HOROVOD_*/TF_*/-x and the
    working directory reach them; the secret is the same everywhere and on no command line."""
    script = tmp_path / "probe.py"
    script.write_text(ENV_PROBE)
    env = _env(SDP_TEST_FORWARD="s", HOROVOD_TEST_FORWARD="h", TF_TEST_FORWARD="t",
               SDPT_EXPORTED="e", SDPT_NOT_FORWARDED="n")
    res = sdprun(hosts, "-np", "3", "-H", "h1:1,h2:2", "-x", "SDPT_EXPORTED", "-x", "SDPT_SET=v=1",
                 sys.executable, str(script), env=env, cwd=str(tmp_path), timeout=60)
    assert res.returncode == 0, res.stderr
    rows = {r: json.loads(lines[0]) for r, lines in _by_rank(res.stdout).items()}
    assert sorted(rows) == [0, 1, 2]
    assert [rows[r]["host"] for r in range(3)] == ["h1", "h2", "h2"]
    assert [rows[r]["SDP_HOSTNAME"] for r in range(3)] == ["h1", "h2", "h2"]
    assert [(rows[r]["SDP_LOCAL_RANK"], rows[r]["SDP_CROSS_RANK"]) for r in range(3)] == \
        [("0", "0"), ("0", "1"), ("1", "0")]
    for r, row in rows.items():
        assert row["cwd"] == str(tmp_path)
        assert (row["SDP_TEST_FORWARD"], row["HOROVOD_TEST_FORWARD"], row["TF_TEST_FORWARD"]) == ("s", "h", "t")
        assert (row["SDPT_EXPORTED"], row["SDPT_SET"]) == ("e", "v=1")
        assert row["PYTHONPATH"].split(os.pathsep)[0] == REPO
        assert row["SDP_RENDEZVOUS_ADDR"].startswith("tcp://10.77.0.1:"), row  # h1's bridge address
        assert row["secret_in_argv"] == [], f"rank {r}: the secret is on command lines {row['secret_in_argv']}"
        assert len(row["secret"]) == 64 and row["secret"] == rows[0]["secret"]
    assert rows[0]["SDPT_NOT_FORWARDED"] == "n"  # local ranks keep the whole environment
    assert rows[1]["SDPT_NOT_FORWARDED"] is None and rows[2]["SDPT_NOT_FORWARDED"] is None


def test_check_reports_each_host(hosts):
    res = sdprun(hosts, "--check", "-H", "h1:2,h2:2,h3:1", timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 3, lines
    py = ".".join(map(str, sys.version_info[:3]))
    for h, line in zip(hosts.names, lines):
        assert line.startswith(f"{h}: reachable ({'local' if h == 'h1' else 'ssh'}), hostname {h}, "
                               f"Python {py}, sdp "), line
        assert re.search(r"/dev/shm \d+\.\d GiB free", line), line
    assert "interface eth0 (10.77.0.2) towards sdprun's 10.77.0.1 on eth0" in lines[1]
    assert "local, interface eth0 (10.77.0.1)" in lines[0]  # h1 would listen towards the others
    res = sdprun(hosts, "--check", "-H", "h2:1", "--ssh-port", "2", timeout=60)  # nothing listens on 2
    assert res.returncode == 1 and res.stdout.startswith("h2: UNREACHABLE (ssh): "), res.stdout


def test_remote_exit_code_nic_and_unreachable_host(hosts, tmp_path):
    """A remote rank's exit status is sdprun's and stops the job at once; -nic eth0 puts the
    rendezvous on that interface; a host ssh cannot reach gives 255 with ssh's own message."""
    code = ("import os, sys, time\n"
            "print(os.environ['SDP_IFACE'], os.environ['SDP_RENDEZVOUS_ADDR'], flush=True)\n"
            f"open(os.path.join({str(tmp_path)!r}, os.environ['SDP_RANK']), 'w').close()\n"
            "if os.environ['SDP_RANK'] != '2': time.sleep(60)\n"
            f"while len(os.listdir({str(tmp_path)!r})) < 3: time.sleep(0.05)\n"  # all have printed
            "sys.exit(5)\n")
    t0 = time.monotonic()
    res = sdprun(hosts, "-nic", "eth0", "-H", "h1:1,h2:1,h3:1", sys.executable, "-c", code, timeout=60)
    assert res.returncode == 5, res.stderr
    assert time.monotonic() - t0 < 10
    assert "worker 2 (ssh pid" in res.stderr and "exited with code 5" in res.stderr
    rows = _by_rank(res.stdout)
    assert sorted(rows) == [0, 1, 2]
    assert all(lines[0].startswith("eth0 tcp://10.77.0.1:") for lines in rows.values()), rows
    res = sdprun(hosts, "-H", "h1:1,h2:1", "--ssh-port", "2", sys.executable, "-c", "print(1)", timeout=60)
    assert res.returncode == 255, res.stderr
    assert "[1]<stderr>:ssh: connect to host h2 port 2: Connection refused" in res.stderr.splitlines(), res.stderr
    assert "ssh itself failed" in res.stderr


COLLECTIVES = r"""
import os, sys
import numpy as np
import sdp
sdp.init()
r, n = sdp.rank(), sdp.size()
for count in (0, 1, 7, 1000, 300_001):
    for dtype in (np.float32, np.float64, np.int32):
        x = (np.arange(count) % 13 + r).astype(dtype)
        want = sum((np.arange(count) % 13 + q).astype(dtype) for q in range(n))
        got = sdp.allreduce(x, op=sdp.Sum, name=f"ar{count}{np.dtype(dtype).name}")
        assert got.dtype == dtype and np.array_equal(got, want), (count, dtype)
g = sdp.allgather(np.full((r + 1, 3), r, np.float32), name="ag")
assert np.array_equal(g, np.concatenate([np.full((q + 1, 3), q, np.float32) for q in range(n)]))
b = sdp.broadcast(np.arange(5.0) + r, root_rank=n - 1, name="bc")
assert np.array_equal(b, np.arange(5.0) + n - 1)
print("OK", r, n, sdp.local_rank(), sdp.local_size(), sdp.cross_rank(), sdp.cross_size())
"""


def test_collectives_hostfile_three_uneven_hosts(hosts, tmp_path):
    """--hostfile with 2+1+2 ranks on h1, h2, h3 (instead of a second and third MNIST run):
    allreduce (sizes 0..300001, 3 dtypes), allgather and broadcast equal numpy's."""
    script = tmp_path / "coll.py"
    script.write_text(COLLECTIVES)
    hostfile = hosts.hostfile({"h1": 2, "h2": 1, "h3": 2})
    res = sdprun(hosts, "--hostfile", hostfile, sys.executable, str(script), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {r: lines[-1].split() for r, lines in _by_rank(res.stdout).items()}
    assert rows == {0: ["OK", "0", "5", "0", "2", "0", "3"], 1: ["OK", "1", "5", "1", "2", "0", "2"],
                    2: ["OK", "2", "5", "0", "1", "1", "3"], 3: ["OK", "3", "5", "0", "2", "2", "3"],
                    4: ["OK", "4", "5", "1", "2", "1", "2"]}


@pytest.mark.slow
@pytest.mark.tf
@pytest.mark.skipif(not os.path.isdir(MNIST_DIR), reason=f"no MNIST data in {MNIST_DIR}")
def test_mnist_two_hosts(hosts):
    """The issue's acceptance run: examples/tf2_mnist.py on 2 hosts x 2 ranks launched by sdprun
    over ssh: the same weights on every rank, test accuracy >= 0.96 after 80 steps (CI), >= 0.97
    after the full epoch with SDP_TEST_ACCEPTANCE=1 (replay.mnist_args)."""
    res = sdprun(hosts, "-np", "4", "-H", "h1:2,h2:2", sys.executable, "examples/tf2_mnist.py",
                 "--data-dir", MNIST_DIR, *replay.mnist_args(), timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    replay.check_mnist(_by_rank(res.stdout), 4)


# ---------------------------------------------------------------- faults

FAULT_WORKER = r"""
import json, os, signal, sys, time
import numpy as np
import sdp
from sdp.common.errors import PeerLostError
rank = int(os.environ['SDP_RANK'])
if os.environ.get('SDP_TEST_IGNORE_TERM') and rank != int(os.environ.get('SDP_TEST_VICTIM', -1)):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # so the report below is seen before sdprun's stop
sdp.init()
d = os.environ['SDP_TEST_DIR']
with open(os.path.join(d, f'{rank}.tmp'), 'w') as f:
    json.dump({'pid': os.getpid(), 'job': os.environ['SDP_JOB_ID']}, f)
os.replace(os.path.join(d, f'{rank}.tmp'), os.path.join(d, f'{rank}.json'))
x = np.ones(1000, np.float32)
t_lost = None
try:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        sdp.allreduce(x, op=sdp.Sum, name='step')
        time.sleep(0.01)
except PeerLostError as e:
    print(f'LOST rank={e.rank} at={time.time():.3f} {e}', flush=True)
    sys.exit(3)
"""


class Job:
    """sdprun on h1 running FAULT_WORKER; knows each rank's pid and the job id."""

    def __init__(self, hosts, tmp_path, spec, np_, ignore_term=True, victim=-1):
        (tmp_path / "w.py").write_text(FAULT_WORKER)
        env = _env(SDP_TEST_DIR=str(tmp_path), SDP_TEST_VICTIM=str(victim), **({"SDP_TEST_IGNORE_TERM": "1"} if ignore_term else {}))
        self.hosts = hosts
        self.marker = str(tmp_path / "w.py")
        self.proc = hosts.popen("h1", _sdprun_argv("-H", spec, "-np", str(np_), sys.executable, self.marker),
                                env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.ranks = replay.wait_fault_ranks(self.proc, tmp_path, np_)
        self.job = self.ranks[0]["job"]

    def finish(self, timeout=40):
        try:
            out, err = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        return self.proc.returncode, out, err


def _ssh_client_of(job, rank):
    """The pid of the local ssh client that runs ``rank`` (a child of sdprun on h1)."""
    ppid = job.proc.pid
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmd = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == ppid and cmd[0] == b"ssh":
            yield int(entry)


LINK_DOWN_BOUND_S = 10


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill_remote_rank", "kill_ssh_session", "link_down"])
def test_fault_gives_peer_lost_everywhere_and_leaves_nothing(hosts, tmp_path, fault):
    """2x2 ranks on h1, h2.  A rank on h2 killed with SIGKILL, the ssh session of rank 2 killed,
    or h2's link cut: every surviving rank raises PeerLostError naming a lost rank within 10 s,
    sdprun exits non-zero, and no process or /dev/shm file of the job is left on any host."""
    job = Job(hosts, tmp_path, "h1:2,h2:2", 4, victim=2 if fault == "kill_ssh_session" else -1)
    t0 = time.time()
    try:
        if fault == "kill_remote_rank":
            lost, survivors = {3}, [0, 1, 2]
            os.kill(job.ranks[3]["pid"], signal.SIGKILL)
        elif fault == "kill_ssh_session":
            lost, survivors = {2}, [0, 1, 3]
            clients = sorted(_ssh_client_of(job, 2))
            assert len(clients) == 2, clients  # ranks 2 and 3; rank 2's client was started first
            os.kill(clients[0], signal.SIGKILL)
        else:
            lost, survivors = {2, 3}, [0, 1]
            hosts.link("h2", up=False)
        rc, out, err = job.finish()
    finally:
        if fault == "link_down":
            hosts.link("h2", up=True)
    assert rc != 0, err
    # A cut link is noticed by ZeroMQ's heartbeats (sdp.transport.zmq_mesh: HEARTBEAT_TIMEOUT 8 s,
    # then LOSS_GRACE_S): measured 10.2-10.5 s here, over the 10 s target (engine side).
    bound_s = LINK_DOWN_BOUND_S if fault == "link_down" else 10
    reports = replay.lost_reports(_by_rank(out), t0)
    for r in survivors:
        assert r in reports, f"rank {r} reported no PeerLostError:\n{out}\n{err[-3000:]}"
        assert reports[r][0] in lost and reports[r][1] < bound_s, (r, reports[r])
    _no_job_left(hosts, job.job, job.marker, wait_s=20 if fault == "link_down" else 10)


@pytest.mark.slow
def test_sigkill_of_sdprun_leaves_no_process_on_any_host(hosts, tmp_path):
    job = Job(hosts, tmp_path, "h1:1,h2:1,h3:1", 3, ignore_term=False)
    os.kill(job.proc.pid, signal.SIGKILL)  # `ip netns exec` and `sh` exec'd into sdprun: same pid
    job.proc.wait(timeout=10)
    _no_job_left(hosts, job.job, job.marker, wait_s=10)


@pytest.mark.slow
def test_sigterm_of_sdprun_stops_all_hosts(hosts, tmp_path):
    job = Job(hosts, tmp_path, "h1:1,h2:1,h3:1", 3, ignore_term=False)
    t0 = time.monotonic()
    job.proc.send_signal(signal.SIGTERM)
    rc, out, err = job.finish(timeout=20)
    assert rc == 128 + signal.SIGTERM, err
    assert time.monotonic() - t0 < 5
    _no_job_left(hosts, job.job, job.marker, wait_s=5)


HOROVOD_RUN = r"""
import socket, sys
import sdp.compat
sdp.compat.install("horovod")
import horovod


def work(base):
    import os
    import numpy as np
    import sdp
    sdp.init()
    total = sdp.allreduce(np.array([float(sdp.rank() + base)]), op=sdp.Sum)
    return sdp.rank(), socket.gethostname(), os.environ["SDP_TEST_ENV"], float(total[0])


if __name__ == "__main__":
    print("RESULTS", horovod.run(work, args=(10,), np=3, hosts="h1:1,h2:1,h3:1", env={"SDP_TEST_ENV": "e"}))
    try:
        horovod.run(lambda: 1, np=2, hosts="h1:1,h2:1")
    except Exception as e:
        print("UNPICKLABLE", type(e).__name__)
"""


def test_horovod_run_across_hosts(hosts, tmp_path):
    """horovod.run(fn, np=3, hosts="h1:1,h2:1,h3:1") from h1: fn (in the caller's main script)
    runs on all three hosts and the results come back in rank order; a lambda is refused."""
    script = tmp_path / "hrun.py"
    script.write_text(HOROVOD_RUN)
    res = hosts.run("h1", [sys.executable, str(script)], env=_env(), cwd=str(tmp_path), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "RESULTS [(0, 'h1', 'e', 33.0), (1, 'h2', 'e', 33.0), (2, 'h3', 'e', 33.0)]" in res.stdout, res.stdout
    assert "UNPICKLABLE PicklingError" in res.stdout, res.stdout

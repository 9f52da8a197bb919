"""Tests of ``sdprun`` (sdp.launcher): host parsing, rank assignment, and real local launches."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from sdp.launcher import cli, hosts, ssh
from sdp.launcher.hosts import HostSlots
from sdp.launcher.procs import exit_code

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- host lists and rank assignment

def test_parse_hosts():
    assert hosts.parse_hosts("a:2,b:3") == [HostSlots("a", 2), HostSlots("b", 3)]
    assert hosts.parse_hosts(" localhost:4 ") == [HostSlots("localhost", 4)]
    assert hosts.parse_hosts("a,b:2") == [HostSlots("a", 1), HostSlots("b", 2)]


@pytest.mark.parametrize("spec", ["", ",", "a:x", "a:0", "a:-1", "a:1,a:2", ":2", "a:1:2"])
def test_parse_hosts_errors(spec):
    with pytest.raises(ValueError):
        hosts.parse_hosts(spec)


def test_parse_hostfile_text():
    text = textwrap.dedent("""\
        # comment
        node1 slots=4
        node2:2   # trailing comment

        node3 slots=1 max_slots=8
        node4
        """)
    assert hosts.parse_hostfile_text(text) == [
        HostSlots("node1", 4), HostSlots("node2", 2), HostSlots("node3", 1), HostSlots("node4", 1)]


@pytest.mark.parametrize("text", ["", "# only a comment\n", "a slots=x\n", "a junk\n", "a:2\na:1\n"])
def test_parse_hostfile_errors(text):
    with pytest.raises(ValueError):
        hosts.parse_hostfile_text(text)


def test_parse_hostfile_reads_file(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("localhost slots=2\n")
    assert hosts.parse_hostfile(str(path)) == [HostSlots("localhost", 2)]


def _topo(infos):
    return ([i.rank for i in infos], [i.local_rank for i in infos], [i.local_size for i in infos],
            [i.cross_rank for i in infos], [i.cross_size for i in infos], [i.hostname for i in infos])


def test_assign_two_by_two():
    infos = hosts.assign_ranks(hosts.parse_hosts("a:2,b:2"), 4)
    assert _topo(infos) == ([0, 1, 2, 3], [0, 1, 0, 1], [2, 2, 2, 2], [0, 0, 1, 1], [2, 2, 2, 2],
                            ["a", "a", "b", "b"])
    assert all(i.size == 4 for i in infos)


def test_assign_uneven_hosts():
    infos = hosts.assign_ranks([HostSlots("a", 1), HostSlots("b", 3), HostSlots("c", 2)], 6)
    # local rank 0 is on a, b, c; local rank 1 on b, c; local rank 2 on b only
    assert _topo(infos)[1:] == ([0, 0, 1, 2, 0, 1], [1, 3, 3, 3, 2, 2], [0, 1, 0, 0, 2, 1],
                                [3, 3, 2, 1, 3, 2], ["a", "b", "b", "b", "c", "c"])


def test_assign_fewer_ranks_than_slots():
    infos = hosts.assign_ranks(hosts.parse_hosts("a:2,b:2,c:2"), 3)
    assert _topo(infos)[1:] == ([0, 1, 0], [2, 2, 1], [0, 0, 1], [2, 1, 2], ["a", "a", "b"])


def test_assign_errors():
    with pytest.raises(ValueError, match="exceeds"):
        hosts.assign_ranks(hosts.parse_hosts("a:2,b:1"), 4)
    with pytest.raises(ValueError):
        hosts.assign_ranks(hosts.parse_hosts("a:2"), 0)


def test_rank_env():
    env = hosts.assign_ranks([HostSlots("a", 2)], 2)[1].env()
    want = {"RANK": "1", "SIZE": "2", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "CROSS_RANK": "0", "CROSS_SIZE": "1",
            "HOSTNAME": "a"}
    assert env == {**{f"SDP_{k}": v for k, v in want.items()}, **{f"HOROVOD_{k}": v for k, v in want.items()}}


def test_streaming_copies_tunable_added_kept_or_merged():
    key = cli.NON_TEMPORAL_TUNABLE
    assert cli.with_streaming_copies({})["GLIBC_TUNABLES"] == f"{key}=131072"
    merged = cli.with_streaming_copies({"GLIBC_TUNABLES": "glibc.malloc.check=0"})
    assert merged["GLIBC_TUNABLES"] == f"glibc.malloc.check=0:{key}=131072"
    mine = {"GLIBC_TUNABLES": f"{key}=99999999", "X": "1"}
    assert cli.with_streaming_copies(mine) == mine  # the user's own value wins


@pytest.mark.skipif(not os.path.exists("/lib64/ld-linux-x86-64.so.2"), reason="needs x86-64 glibc")
def test_workers_get_glibc_non_temporal_threshold():
    """glibc in the workers really parses the value sdprun sets (ld.so lists its tunables)."""
    probe = ("import os, subprocess; print(subprocess.run(['/lib64/ld-linux-x86-64.so.2', "
             "'--list-tunables'], capture_output=True, text=True).stdout)")
    res = _sdprun("-np", "1", "--no-prefix", "python", "-c", probe)
    assert res.returncode == 0, res.stderr
    line = [ln for ln in res.stdout.splitlines() if ln.startswith(cli.NON_TEMPORAL_TUNABLE)]
    assert line and line[0].split()[1] == hex(cli.NON_TEMPORAL_BYTES), res.stdout


def test_is_local():
    assert hosts.is_local("localhost") and hosts.is_local("127.0.0.1")
    import socket
    assert hosts.is_local(socket.gethostname())
    assert not hosts.is_local("some-remote-node.example.com")


def test_exit_code():
    assert exit_code(0) == 0 and exit_code(3) == 3 and exit_code(-signal.SIGKILL) == 128 + 9


def test_parser_accepts_horovodrun_and_kungfu_flags():
    p = cli.build_parser()
    a = p.parse_args(["-np", "2", "-H", "localhost:2", "--verbose", "-nic", "eth0", "--start-timeout",
                      "5", "--compat", "horovod", "python", "train.py", "-np", "7"])
    assert (a.np, a.hosts, a.nic, a.start_timeout, a.compat) == (2, "localhost:2", "eth0", 5.0, "horovod")
    assert a.command == ["python", "train.py", "-np", "7"]
    a = p.parse_args(["--num-proc", "2", "--network-interface", "lo", "--", "python", "-c", "1"])
    assert a.np == 2 and a.nic == "lo" and a.command == ["--", "python", "-c", "1"]


# ---------------------------------------------------------------- real launches

def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.pop(cli.ALLOW_FAKE_HOSTS_ENV, None)
    env.update(extra)
    return env


def _sdprun(*args, timeout=20, env=None):
    return subprocess.run([sys.executable, "-m", "sdp.launcher.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env or _env(), cwd=REPO)


def _gone(pid, wait_s=2.0):
    """True once ``pid`` is dead (a zombie waiting for init to reap it counts as dead)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.05)
    return False


def _read_pids(directory, n, wait_s=10.0):
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        files = [f for f in os.listdir(directory) if f.endswith(".pid")]
        if len(files) == n:
            return [int(open(os.path.join(directory, f)).read()) for f in files]
        time.sleep(0.05)
    raise AssertionError(f"only {os.listdir(directory)} written in {wait_s} s")


ENV_KEYS = ["SDP_RANK", "SDP_SIZE", "SDP_LOCAL_RANK", "SDP_LOCAL_SIZE", "SDP_CROSS_RANK",
            "SDP_CROSS_SIZE", "SDP_HOSTNAME", "SDP_RENDEZVOUS_ADDR", "SDP_JOB_ID", "SDP_START_TIMEOUT",
            "PYTHONUNBUFFERED"]
PRINT_ENV = f"import os; print(' '.join(os.environ.get(k, '-') for k in {ENV_KEYS!r}))"


def _env_lines(stdout):
    rows = {}
    for line in stdout.splitlines():
        prefix, _, rest = line.partition(":")
        rank = int(prefix[1:prefix.index("]")])
        assert prefix == f"[{rank}]<stdout>"
        rows[rank] = dict(zip(ENV_KEYS, rest.split(" ")))
    return rows


def test_run_three_local_ranks():
    import socket
    res = _sdprun("-np", "3", "python", "-c", PRINT_ENV)
    assert res.returncode == 0, res.stderr
    rows = _env_lines(res.stdout)
    assert sorted(rows) == [0, 1, 2]
    for r, row in rows.items():
        assert row["SDP_RANK"] == str(r) and row["SDP_SIZE"] == "3"
        assert row["SDP_LOCAL_RANK"] == str(r) and row["SDP_LOCAL_SIZE"] == "3"
        assert row["SDP_CROSS_RANK"] == "0" and row["SDP_CROSS_SIZE"] == "1"
        assert row["SDP_HOSTNAME"] == socket.gethostname()
        assert row["SDP_RENDEZVOUS_ADDR"].startswith("tcp://127.0.0.1:")
        assert row["SDP_START_TIMEOUT"] == "60" and row["PYTHONUNBUFFERED"] == "1"
        int(row["SDP_JOB_ID"], 16)
    assert len({row["SDP_RENDEZVOUS_ADDR"] for row in rows.values()}) == 1
    assert len({row["SDP_JOB_ID"] for row in rows.values()}) == 1
    again = _env_lines(_sdprun("-np", "1", "--", "python", "-c", PRINT_ENV).stdout)
    assert again[0]["SDP_JOB_ID"] != rows[0]["SDP_JOB_ID"]


def test_fake_hosts_topology_and_flags():
    res = _sdprun("-H", "a:2,b:2", "-nic", "lo", "--compat", "kungfu", "--start-timeout", "7",
                  "python", "-c", "import os; print(os.environ['SDP_HOSTNAME'], os.environ['SDP_LOCAL_RANK'],"
                  " os.environ['SDP_CROSS_RANK'], os.environ['SDP_CROSS_SIZE'], os.environ['SDP_IFACE'],"
                  " os.environ['SDP_COMPAT'], os.environ['SDP_START_TIMEOUT'])",
                  env=_env(SDP_LAUNCHER_ALLOW_FAKE_HOSTS="1"))
    assert res.returncode == 0, res.stderr
    lines = sorted(res.stdout.splitlines())
    assert lines == ["[0]<stdout>:a 0 0 2 lo kungfu 7", "[1]<stdout>:a 1 0 2 lo kungfu 7",
                     "[2]<stdout>:b 0 1 2 lo kungfu 7", "[3]<stdout>:b 1 1 2 lo kungfu 7"]


def test_forwarded_env_and_exports():
    env = {"PATH": "/p", "PYTHONPATH": "/pp", "LD_LIBRARY_PATH": "/l", "SDP_RANK": "1",
           "HOROVOD_FUSION_THRESHOLD": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "HOME": "/root", "MINE": "x",
           "SECRETISH": "no"}
    assert ssh.forwarded_env(env, ["MINE"]) == {k: v for k, v in env.items() if k not in ("HOME", "SECRETISH")}
    assert cli.parse_exports(["A=1", "B", "C=x=y"], {"B": "2"}) == {"A": "1", "B": "2", "C": "x=y"}
    with pytest.raises(ValueError, match="not set"):
        cli.parse_exports(["NOPE"], {})
    with pytest.raises(ValueError, match="not a variable name"):
        cli.parse_exports(["1X=2"], {})


def test_ssh_command_line_has_no_secret_or_environment():
    argv = ssh.ssh_argv("node-a", ssh.SshOptions(2222, "/k/id"), ssh.REMOTE_MAIN)
    assert argv[:2] == ["ssh", "-T"] and "BatchMode=yes" in argv
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-i") + 1] == "/k/id"
    assert argv[-2] == "node-a" and "sdp.launcher.remote" in argv[-1]
    assert "SDP_" not in " ".join(argv)


def test_listen_address_never_any():
    assert cli.listen_address([], None) == "127.0.0.1"
    assert cli.listen_address([], "lo") == "127.0.0.1"
    with pytest.raises(ValueError, match="does not exist"):
        cli.listen_address([], "sdp-no-such-nic0")


def _remote(spec, stdin_close=True, timeout=20):
    """Run sdp.launcher.remote locally (what ssh runs on a remote host) with ``spec``."""
    p = subprocess.Popen([sys.executable, "-m", "sdp.launcher.remote"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=REPO)
    p.stdin.write(spec)
    p.stdin.flush()
    if stdin_close:
        p.stdin.close()
    return p


def test_remote_side_runs_rank_with_env_and_cwd(tmp_path):
    import json
    spec = {"command": ["python", "-c", "import os, sys; print(os.getcwd(), os.environ['SDP_X']); sys.exit(7)"],
            "env": {"SDP_X": "hello", "PATH": os.environ["PATH"]}, "cwd": str(tmp_path), "grace_s": 1}
    p = _remote(json.dumps(spec).encode() + b"\n", stdin_close=False)
    assert p.wait(timeout=20) == 7, p.stderr.read()  # stdin still open: EOF would stop the rank
    out = p.stdout.read()
    p.stdin.close()
    assert out.decode().split() == [str(tmp_path), "hello"]
    for bad in (b"", b"{not json\n", b'{"command": "ls", "env": {}}\n', b'{"command": ["x"], "env": {"A": 1}}\n'):
        p = _remote(bad)
        rc, err = p.wait(timeout=20), p.stderr.read()
        assert rc == 2 and b"job description" in err, (bad, err)
    p = _remote(json.dumps(dict(spec, command=["sdp-no-such-command-xyz"])).encode() + b"\n")
    assert p.wait(timeout=20) == 127


def test_remote_side_kills_tree_on_eof_and_forwards_signals(tmp_path):
    """End of ssh's stdin (lost session, SIGKILLed sdprun) ends the rank and what it started;
    ``signal N`` lines reach the rank's process group."""
    import json
    code = ("import os, subprocess, sys, time\n"
            f"d = {str(tmp_path)!r}\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "open(os.path.join(d, 'pids.tmp'), 'w').write(f'{os.getpid()} {child.pid}')\n"
            "os.replace(os.path.join(d, 'pids.tmp'), os.path.join(d, 'x.pid'))\n"
            "time.sleep(60)\n")
    for how in ("eof", "signal"):
        for f in tmp_path.glob("*.pid"):
            f.unlink()
        spec = {"command": [sys.executable, "-c", code], "env": {}, "cwd": str(tmp_path), "grace_s": 1}
        p = _remote(json.dumps(spec).encode() + b"\n", stdin_close=False)
        deadline = time.monotonic() + 10
        while not list(tmp_path.glob("*.pid")) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [int(x) for x in (tmp_path / "x.pid").read_text().split()]
        t0 = time.monotonic()
        if how == "eof":
            p.stdin.close()
        else:
            p.stdin.write(b"signal 15\n")
            p.stdin.flush()
        rc = p.wait(timeout=10)
        assert rc == 128 + 15, (how, rc, p.stderr.read())
        assert time.monotonic() - t0 < 3
        for pid in pids:
            assert _gone(pid, wait_s=3), (how, pid)


def test_too_many_processes_and_usage_errors(tmp_path):
    res = _sdprun("-np", "3", "-H", "localhost:2", "true")
    assert res.returncode == 2 and "exceeds" in res.stderr
    assert _sdprun("-np", "2").returncode == 2
    assert _sdprun().returncode == 2
    assert _sdprun("-np", "1", "sdp-no-such-command-xyz").returncode == 127
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    res = _sdprun("--hostfile", str(hostfile), "python", "-c", "print('hi')")
    assert res.returncode == 0 and sorted(res.stdout.splitlines()) == ["[0]<stdout>:hi", "[1]<stdout>:hi"]


def test_stderr_prefixed():
    res = _sdprun("-np", "2", "python", "-c", "import sys; print('oops', file=sys.stderr)")
    assert res.returncode == 0
    assert "[0]<stderr>:oops" in res.stderr.splitlines() and "[1]<stderr>:oops" in res.stderr.splitlines()
    assert res.stdout == ""


def test_workers_can_rendezvous():
    code = ("import os; from sdp.transport.rendezvous import register; "
            "r = int(os.environ['SDP_RANK']); "
            "t = register(os.environ['SDP_RENDEZVOUS_ADDR'], {'rank': r, 'size': int(os.environ['SDP_SIZE']),"
            " 'host': os.environ['SDP_HOSTNAME']}, 10); print(len(t), [p['rank'] for p in t])")
    res = _sdprun("-np", "3", "python", "-c", code)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == [f"[{r}]<stdout>:3 [0, 1, 2]" for r in range(3)]


FAILING_WORKER = """
import os, sys, time
tmp = os.path.join({d!r}, os.environ['SDP_RANK'] + '.tmp')
open(tmp, 'w').write(str(os.getpid()))
os.replace(tmp, tmp[:-4] + '.pid')
if os.environ['SDP_RANK'] == '1':
    while len([f for f in os.listdir({d!r}) if f.endswith('.pid')]) < {n}:
        time.sleep(0.02)
    {fail}
time.sleep(60)
"""


@pytest.mark.parametrize("fail,expected", [("raise RuntimeError('worker one failed')", 1),
                                           ("sys.exit(3)", 3),
                                           ("os.kill(os.getpid(), 9)", 128 + 9)])
def test_failing_worker_stops_everyone(tmp_path, fail, expected):
    start = time.monotonic()
    res = _sdprun("-np", "3", "python", "-c", FAILING_WORKER.format(d=str(tmp_path), fail=fail, n=3))
    elapsed = time.monotonic() - start
    assert res.returncode == expected, res.stderr
    assert elapsed < 10
    if expected == 1:
        err = res.stderr.splitlines()
        assert "[1]<stderr>:Traceback (most recent call last):" in err
        assert "[1]<stderr>:RuntimeError: worker one failed" in err
    assert "worker 1" in res.stderr
    for pid in _read_pids(tmp_path, 3):
        assert _gone(pid), f"worker pid {pid} still alive"


def test_worker_ignoring_sigterm_is_killed(tmp_path):
    worker = FAILING_WORKER.format(d=str(tmp_path), fail="sys.exit(5)", n=2).replace(
        "import os, sys, time", "import os, sys, time, signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    start = time.monotonic()
    res = _sdprun("-np", "2", "python", "-c", worker)
    assert res.returncode == 5
    assert time.monotonic() - start < 10  # 3 s grace, then SIGKILL
    for pid in _read_pids(tmp_path, 2):
        assert _gone(pid)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_sdprun_kills_workers(tmp_path, sig):
    code = ("import os, subprocess, sys, time\n"
            f"d = {str(tmp_path)!r}\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "def put(name, pid):\n"
            "    open(os.path.join(d, name + '.tmp'), 'w').write(str(pid))\n"
            "    os.replace(os.path.join(d, name + '.tmp'), os.path.join(d, name + '.pid'))\n"
            "put('child' + os.environ['SDP_RANK'], child.pid)\n"
            "put(os.environ['SDP_RANK'], os.getpid())\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-m", "sdp.launcher.cli", "-np", "2", "python", "-c", code],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=REPO)
    try:
        pids = _read_pids(tmp_path, 4)
        proc.send_signal(sig)
        proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig
    for pid in pids:  # workers and the grandchildren they started
        assert _gone(pid), f"pid {pid} still alive"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_sigkill_of_sdprun_does_not_orphan_workers(tmp_path):
    """Even SIGKILL (which sdprun cannot catch) takes the workers down: they have PDEATHSIG."""
    import signal as _signal
    import subprocess as _sp
    import time as _time
    pidfile = tmp_path / "pids"
    code = f"import os,time; open({str(pidfile)!r},'a').write(str(os.getpid())+'\\n'); time.sleep(60)"
    p = _sp.Popen([sys.executable, "-m", "sdp.launcher.cli", "-np", "2", sys.executable, "-c", code],
                  stdout=_sp.DEVNULL, stderr=_sp.DEVNULL)
    deadline = _time.monotonic() + 20
    while _time.monotonic() < deadline and (not pidfile.exists() or len(pidfile.read_text().split()) < 2):
        _time.sleep(0.05)
    pids = [int(x) for x in pidfile.read_text().split()]
    p.send_signal(_signal.SIGKILL)
    p.wait(timeout=10)
    alive = [pid for pid in pids if not _gone(pid, wait_s=10)]
    assert not alive, f"workers {alive} outlived a SIGKILLed sdprun"


def test_sdp_worker_that_raises_stops_job_fast(tmp_path):
    """A worker that raises after sdp.init() exits at once (its shutdown does not wait for the
    peers), so sdprun reports it with the traceback well within 10 s."""
    script = tmp_path / "raise.py"
    script.write_text("import time, sdp\nsdp.init()\nif sdp.rank() == 1:\n"
                      "    raise RuntimeError('boom from rank 1')\ntime.sleep(60)\n")
    t0 = time.monotonic()
    p = _sdprun("-np", "2", sys.executable, str(script), timeout=30)
    assert p.returncode == 1
    assert "[1]<stderr>:RuntimeError: boom from rank 1" in p.stderr
    assert time.monotonic() - t0 < 10


def test_segments_left_by_killed_workers_are_removed():
    """A rank SIGKILLed before every peer mapped its /dev/shm segment cannot unlink it; sdprun
    removes the job's segment files when the job ends."""
    leak = ("import os; open('/dev/shm/sdp-' + os.environ['SDP_JOB_ID'] + '-' + os.environ['SDP_RANK'] + '-1', 'w')"
            ".write('x'); print(os.environ['SDP_JOB_ID'])")
    res = _sdprun("-np", "2", "--no-prefix", "python", "-c", leak)
    assert res.returncode == 0, res.stderr
    job = res.stdout.split()[0]
    assert len(job) == 16
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"sdp-{job}-")]


# ---------------------------------------------------------------- output pumps, stalls, quiet stops

def _pumped(data: bytes, times=None):
    """What procs._pump shows for ``data`` (one read per chunk of a list), as text."""
    import io
    from sdp.launcher import procs

    class Chunks(io.RawIOBase):
        def __init__(self, chunks):
            self.chunks = list(chunks)

        def read1(self, n=-1):
            return self.chunks.pop(0) if self.chunks else b""

    out = io.StringIO()
    clock = iter(times).__next__ if times is not None else (lambda: 0.0)
    procs._pump(Chunks(data if isinstance(data, list) else [data]), "[0]:", procs._Sink(out, threading.Lock()),
                clock=clock)
    return out.getvalue()


def test_pump_shows_in_place_progress_at_most_every_interval():
    # a Keras-style bar: "\b...\r<bar>" redraws, a final "<bar>\n"
    bar = b"".join(b"\b\b\b\r%d/9" % i for i in range(1, 9)) + b"\b\b\b\r9/9 done\n"
    # clock: update 1 at t=0 (shown), 2..7 within 10 s (dropped), 8 at t=10 (shown)
    assert _pumped(bar, times=[0, 1, 2, 3, 4, 5, 6, 10]) == "[0]:1/9\n[0]:8/9\n[0]:9/9 done\n"


def test_pump_lines_crlf_split_reads_and_trailing_text():
    assert _pumped([b"a\r", b"\nb\n", b"tail"]) == "[0]:a\n[0]:b\n[0]:tail\n"
    assert _pumped(b"\r\n") == "[0]:\n"


def test_stalled_rank_prints_its_python_stack(tmp_path):
    """A rank stuck in Python (not in a collective): when rank 0's stall check names it, sdprun
    asks it for its stacks (SIGUSR1, faulthandler) and prints them once, under a line naming the
    rank and its host; the function it is in shows."""
    script = tmp_path / "hang.py"
    script.write_text("import time, numpy as np, sdp\nsdp.init()\n"
                      "def stuck_in_data_loading():\n    time.sleep(60)\n"
                      "if sdp.rank() == 1:\n    stuck_in_data_loading()\n"
                      "sdp.allreduce(np.ones(4), name='grad')\n")
    proc = subprocess.Popen([sys.executable, "-m", "sdp.launcher.cli", "-np", "2", sys.executable, str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=_env(SDP_STALL_CHECK_TIME="1"))
    lines = []
    try:
        deadline = time.monotonic() + 60
        stalls = 0
        while time.monotonic() < deadline and stalls < 3:  # the warning repeats; the stack must not
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip("\n"))
            stalls += "stall:" in line
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=20)
        lines += rest.splitlines()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "\n".join(lines)
    assert stalls == 3, text
    asked = [ln for ln in lines if "its Python stacks follow" in ln]
    assert len(asked) == 1 and "rank 1 (host " in asked[0], text
    assert sum("in stuck_in_data_loading" in ln for ln in lines) == 1, text
    assert [ln for ln in lines if "in stuck_in_data_loading" in ln][0].startswith("[1]<stderr>:"), text
    # issue 54: the script's thread first (its frames before sdp's and ZeroMQ's threads), and the
    # warning says how to end a job that would wait for ever
    dump = [ln[len("[1]<stderr>:"):] for ln in lines if ln.startswith("[1]<stderr>:")]
    assert dump[0] == "Python stack of the script's main thread (most recent call last):", text
    assert any("in stuck_in_data_loading" in ln for ln in dump[:8]), text
    assert all("SDP_STALL_SHUTDOWN_TIME=<seconds>" in ln for ln in lines if "stall:" in ln), text
    # and the quiet stop: one line per rank, no traceback
    assert "[1]<stderr>:rank 1: interrupted (SIGINT)" in lines and "Traceback" not in text, text
    assert proc.returncode == 128 + signal.SIGINT


def test_rank_signals_step_and_line():
    from sdp.common import rank_signals

    def outer():
        step = 7  # noqa: F841  (read from the traceback)
        inner()

    def inner():
        step = "not an int"  # noqa: F841
        raise KeyboardInterrupt

    try:
        outer()
    except KeyboardInterrupt:
        tb = sys.exc_info()[2]
    assert rank_signals.step_of(tb) == 7
    assert rank_signals.interrupted_line("1", signal.SIGTERM, 7) == "rank 1: interrupted at step 7 (SIGTERM)"
    assert rank_signals.interrupted_line("0", signal.SIGINT, None) == "rank 0: interrupted (SIGINT)"


def test_help_groups_options_and_requires_only_the_command():
    text = cli.build_parser().format_help()
    usage = text.split("\n\n")[0]
    assert "[-np N]" in usage and " -np N " not in usage.replace("[-np N]", "")
    for group in ("processes and hosts (horovodrun's and kungfu-run's names)", "network and ssh (horovodrun's names)",
                  "elastic: Horovod Elastic (horovodrun's names)", "elastic: KungFu watch mode (kungfu-run's names)",
                  "accepted and ignored"):
        assert group + ":" in text or group in text, group
    assert "Only COMMAND is required" in text
    res = _sdprun()
    assert res.returncode == 2 and "no command given" in res.stderr


def test_a_rank_that_crashes_after_a_stop_signal_shows_its_stacks(tmp_path):
    """A stop signal silences a rank's fd 2, but a crash after it (here os.abort, as glibc's
    ``free(): ...`` checks end) still writes every thread's Python stack to the original
    standard error, naming the crashing line; what the script writes to stderr stays hidden."""
    script = tmp_path / "crash.py"
    script.write_text(textwrap.dedent("""\
        import os, signal, sys, time
        import sdp
        from sdp.common import rank_signals
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        except KeyboardInterrupt:
            deadline = time.monotonic() + 30
            while rank_signals._stderr_fd is None and time.monotonic() < deadline:
                time.sleep(0.01)  # (the watcher thread silences fd 2)
            print("hidden after the stop", file=sys.stderr, flush=True)
            os.abort()  # the crashing line
        """))
    p = subprocess.run([sys.executable, "-m", "sdp.launcher.cli", "-np", "1", sys.executable, str(script)],
                       capture_output=True, text=True, cwd=REPO, env=_env(), timeout=60)
    out = p.stdout + p.stderr
    assert "Fatal Python error: Aborted" in out, out
    assert "crash.py\", line 12" in out, out
    assert "hidden after the stop" not in out, out
    assert "killed by signal 6" in out, out


def test_ctrl_c_while_a_rank_waits_in_a_collective_is_quiet(tmp_path):
    """SIGINT to sdprun while rank 0 waits inside a tf.function's collective for rank 1 (which is
    in Python): rank 1 stops at once, so rank 0's collective fails with PeerLostError inside
    TensorFlow, which TensorFlow logs from C++.  Still one line per rank, no traceback, exit 130
    within 5 s."""
    pytest.importorskip("tensorflow")
    script = tmp_path / "race.py"
    script.write_text(textwrap.dedent("""\
        import time
        import tensorflow as tf
        import sdp.tensorflow as hvd
        hvd.init()
        x = tf.Variable(tf.ones(4))

        @tf.function
        def step_fn():
            return hvd.allreduce(x * 2.0)

        step = 0
        while True:
            step += 1
            step_fn()
            if step == 3 and hvd.rank() == 0:
                print("ready", flush=True)
            if hvd.rank() == 1:
                time.sleep(0.5)  # rank 1 lags: rank 0 waits inside the collective
        """))
    proc = subprocess.Popen([sys.executable, "-m", "sdp.launcher.cli", "-np", "2", sys.executable, str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=_env(TF_CPP_MIN_LOG_LEVEL="0"))
    try:
        for line in proc.stdout:
            if "ready" in line:
                break
        time.sleep(1.2)  # a few more steps
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = rest.splitlines()
    assert proc.returncode == 128 + signal.SIGINT, rest
    assert elapsed < 5, elapsed
    assert "Traceback" not in rest and "PeerLostError" not in rest, rest
    assert len(lines) <= 3, rest  # sdprun's warning and one line per rank
    for rank in (0, 1):
        assert any(ln.startswith(f"[{rank}]<stderr>:rank {rank}: interrupted at step ") for ln in lines), rest

"""No stranger stops a job (issue 53): 2 x 2 jobs on emulated hosts (tests/emulated_hosts.py) with
idle connections held to every port they listen on from a third host, and to their abstract Unix
sockets from another user; the leaders' link reset under a running job.  Real sockets throughout."""
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import emulated_hosts  # noqa: E402
from workers_strangers import JOB, MESH_RESET, STRANGER, expected_checksum  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 200
SWEPT_STEPS = 5000  # (test_a_port_sweep...)

needs_hosts = pytest.mark.skipif(emulated_hosts.unavailable_reason() is not None,
                                 reason=str(emulated_hosts.unavailable_reason()))


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("SDP_SECRET", "SDP_SECRET_FILE", "SDP_IFACE", "SDP_LAUNCHER_ALLOW_FAKE_HOSTS")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _job(hosts, tmp_path, *args, timeout=90, steps=STEPS):
    """sdprun -np 4 -H h1:2,h2:2 of JOB on h1: (returncode, {rank: its stdout lines}, stderr, seconds)."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    t0 = time.monotonic()
    res = hosts.run("h1", [sys.executable, "-m", "sdp.launcher.cli", "-np", "4", "-H", "h1:2,h2:2",
                           sys.executable, str(script), str(steps), *args], env=_env(), cwd=REPO, timeout=timeout)
    rows = {}
    for line in res.stdout.splitlines():
        m = re.match(r"\[(\d+)\]<stdout>:(.*)", line)
        if m:
            rows.setdefault(int(m.group(1)), []).append(m.group(2))
    return res.returncode, rows, res.stderr, time.monotonic() - t0


def _checksums(rows):
    return {r: float(next(ln for ln in lines if ln.startswith("checksum")).split()[1]) for r, lines in rows.items()}


class _Strangers:
    """The attackers, started before the job and stopped after it: TCP from h3 to every port of
    h1 and h2, and (``unix``) Unix connections as user 65534 on h1 and h2."""

    def __init__(self, hosts, per_port, period, refill=True, unix=True):
        pids = ",".join(str(hosts.sshd[h].pid) for h in ("h1", "h2"))
        self.procs = [hosts.popen("h3", [sys.executable, "-c", STRANGER, f"pids:{pids}", str(per_port), str(period),
                                         "1" if refill else "0"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
        if unix:
            self.procs += [hosts.popen(h, [sys.executable, "-c", STRANGER, "unix:65534", str(per_port), "0.02", "1"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True) for h in ("h1", "h2")]
        for p in self.procs:  # (each has looked once: in place before the job starts)
            p.stdout.readline()

    def stop(self):
        outs = []
        for p in self.procs:
            try:
                out, err = p.communicate(input="", timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
            outs.append(out + err)
        return outs


def _stats(text):
    return {k: int(v) for k, v in re.findall(r"(ports|opened|dropped) (\d+)", text)}


@needs_hosts
@pytest.mark.slow
def test_64_idle_strangers_on_every_port_and_socket_do_not_stop_or_slow_a_job(hosts, tmp_path):
    """64 idle connections held (reopened when dropped) to every TCP port the job listens on
    (sdprun's rendezvous, every rank's mesh and link ports) from h3, and to every abstract Unix
    socket (the ranks' mesh ipc sockets) by user 65534 on h1 and h2, from before the job's start
    to its end: every rank ends with the right checksum, within 10 s of the job's unattacked
    time; the refusals are logged with their sources (on main: the genuine connections were the
    ones refused, and the job died of PeerLostError or a TimeoutError)."""
    rc, rows, err, alone = _job(hosts, tmp_path)
    assert rc == 0, err[-3000:]
    want = expected_checksum(STEPS)
    assert _checksums(rows) == {r: want for r in range(4)}
    attack = _Strangers(hosts, per_port=64, period=0.02)
    try:
        rc, rows, err, attacked = _job(hosts, tmp_path)
    finally:
        outs = attack.stop()
    tcp, unix = _stats(outs[0]), [_stats(o) for o in outs[1:]]
    assert rc == 0, err[-3000:] + "\n".join(outs)
    assert _checksums(rows) == {r: want for r in range(4)}
    assert attacked < alone + 10, (alone, attacked)
    assert tcp["ports"] >= 5 and tcp["opened"] >= 64 * 5, outs  # (sdprun's, 4 meshes', 2 leaders' links)
    assert all(u["opened"] >= 64 and u["dropped"] >= 64 for u in unix), outs  # (another user: dropped at once)
    assert "another user" in err and "uid 65534" in err, err[-3000:]
    print(f"unattacked {alone:.1f} s, attacked {attacked:.1f} s; {outs}")


@needs_hosts
@pytest.mark.slow
def test_a_port_sweep_every_2_s_holding_40_on_each_new_port_stops_no_job(hosts, tmp_path):
    """A scanner on h3 that looks for new listening ports every 2 s and holds 40 idle connections
    on each it finds (never reopened): 5 of 5 jobs end with the right checksums (on main: 2 of 2
    ordinary jobs died 4-8 s after launch).  Each job trains for longer than a sweep's period
    (5,000 steps: 2.5 s of its ports listening on a quiet machine, longer on a busy one), so
    every job is swept at least once."""
    want = expected_checksum(SWEPT_STEPS)
    attack = _Strangers(hosts, per_port=40, period=2.0, refill=False, unix=False)
    try:
        for i in range(5):
            rc, rows, err, _ = _job(hosts, tmp_path, steps=SWEPT_STEPS)
            assert rc == 0, (i, err[-3000:])
            assert _checksums(rows) == {r: want for r in range(4)}, i
    finally:
        outs = attack.stop()
    stats = _stats(outs[0])  # (the sweep reached every job: a port of each at least)
    assert stats["ports"] >= 5 and stats["opened"] >= 40 * 5, outs


@needs_hosts
def test_the_leaders_link_reset_three_times_is_repaired_and_exact(hosts, tmp_path):
    """The host leaders' link connections reset under the job three times (``ss -K`` on host 1's
    leader, as a middlebox's RST or a conntrack flush would; a shutdown(2) of the sockets without
    ss): each is repaired, every rank's checksum is exact and the job ends rc 0 (on main: every
    rank waited for ever)."""
    rc, rows, err, took = _job(hosts, tmp_path, "ss" if shutil.which("ss") else "hook", "1")
    assert rc == 0, err[-3000:]
    assert _checksums(rows) == {r: expected_checksum(STEPS) for r in range(4)}
    repairs = {r: int(next(ln for ln in lines if ln.startswith("checksum")).split()[3]) for r, lines in rows.items()}
    assert repairs[0] >= 3 and repairs[2] >= 3, repairs  # (each leader: its connection out and the one in)
    times = [float(m) for m in re.findall(r"reconnected in (\d+) ms", err)]
    assert times, err[-3000:]
    print(f"job {took:.1f} s; repairs {repairs}; reconnected in {sorted(times)} ms")


@needs_hosts
def test_with_repair_off_a_reset_link_is_peer_lost_on_every_rank_within_10_s(hosts, tmp_path):
    """The same reset with repair turned off by the script: a PeerLostError on every rank, naming
    the leaders' link and the host, within 10 s of the reset, in one flat message."""
    rc, rows, err, took = _job(hosts, tmp_path, "hook", "0")
    assert rc != 0
    for r in range(4):
        line = next((ln for ln in rows.get(r, []) if ln.startswith("ERROR")), None)
        assert line is not None and "PeerLostError" in line, (r, rows, err[-2000:])
        assert "leaders' link" in line and "on host h" in line, line
        assert line.count("lost connection to rank") == 1, line
        assert float(re.search(r"after (\d+\.\d) s$", line).group(1)) < 10, line  # (the reset: a step 50)
    print(f"job {took:.1f} s; {[next(ln for ln in rows[r] if ln.startswith('ERROR')) for r in range(4)]}")


def test_300_idle_strangers_on_an_elastic_jobs_endpoint_do_not_stop_it(tmp_path):
    """300 idle loopback connections held (reopened when dropped) to every port ``sdprun`` of an
    elastic job listens on (its signed HTTP endpoint, its rendezvous) from before the job starts:
    a worker killed at step 12 is replaced by a re-formed job whose survivors' signed /join
    requests get through, and the job ends with every step counted once (on main: the workers'
    requests were refused, "Remote end closed connection without response", 3 of 3 runs died)."""
    import stat
    hosts_file, script = tmp_path / "hosts", tmp_path / "discover.sh"
    hosts_file.write_text("localhost:3\n")
    script.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    env = _env()
    env.update(DIE_WORKER="2", DIE_STEP="12", STEPS="30")
    job = subprocess.Popen([sys.executable, "-m", "sdp.launcher.cli", "-np", "3", "--min-np", "2",
                            "--host-discovery-script", str(script), sys.executable,
                            os.path.join(REPO, "tests", "workers_elastic.py")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    attacker = subprocess.Popen([sys.executable, "-c", STRANGER, f"own:{job.pid}", "300", "0.02", "1"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
        stats = _stats(attacker.communicate(input="", timeout=30)[0])
    assert job.returncode == 0, err[-4000:]
    rows = [ln for ln in out.splitlines() if "RESULT " in ln]
    assert len(rows) == 2 and all("size=2 epoch=1" in r and "value=70.0" in r and "done_ok=True" in r
                                  for r in rows), out[-3000:]
    assert stats["ports"] >= 2 and stats["opened"] >= 300 * 2, stats  # (the endpoint and the rendezvous)


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to reset connections")
def test_a_reset_mesh_connection_is_reported_as_such_not_as_silence(tmp_path):
    """A mesh connection reset under a 2-rank job (``ss -K``; ranks on pretend hosts, so over
    TCP): ZeroMQ redials and the peer refuses the spent token, and the rank whose connection
    dropped says so within seconds (was: "no message from rank 0 for 30 s", blaming a silence
    that never was)."""
    script = tmp_path / "job.py"
    script.write_text(MESH_RESET)
    env = _env()
    env["SDP_LAUNCHER_ALLOW_FAKE_HOSTS"] = "1"
    res = subprocess.run([sys.executable, "-m", "sdp.launcher.cli", "-np", "2", "-H", "hostA:1,hostB:1",
                          sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=90)
    errors = [ln for ln in res.stdout.splitlines() if "ERROR PeerLostError" in ln]
    if not errors and "done" in res.stdout:
        pytest.skip("ss -K closed nothing here (a kernel without CONFIG_INET_DIAG_DESTROY)")
    assert any("refused at authentication" in ln and "30 s" not in ln for ln in errors), res.stdout + res.stderr[-2000:]

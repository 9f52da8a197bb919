"""Open MPI's ``mpirun`` as a launcher across emulated hosts (issue 16, item 2): real ``mpirun``,
real ``orted`` daemons started over the hosts' sshd, real sockets; no MPI library in sdp.

``sdprun --launcher mpi`` and a plain ``mpirun`` on h1 start 2+2 ranks on h1 and h2 (the
``hosts`` fixture of tests/conftest.py).  Skipped without Open MPI (``apt-get install
openmpi-bin``) or where emulated hosts cannot be made.
"""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import emulated_hosts  # noqa: E402
import replay  # noqa: E402

from sdp.launcher import hosts as hostlib  # noqa: E402
from sdp.launcher import mpi  # noqa: E402
from sdp.launcher.ssh import SshOptions  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun (apt-get install openmpi-bin)"),
    pytest.mark.skipif(emulated_hosts.unavailable_reason() is not None,
                       reason=str(emulated_hosts.unavailable_reason())),
]

WORKER = replay.WORKER

EXPECTED = {0: ([0, 2], [0, 2], "h1"), 1: ([1, 2], [0, 2], "h1"),
            2: ([0, 2], [1, 2], "h2"), 3: ([1, 2], [1, 2], "h2")}


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    for name in ("SDP_SECRET", "SDP_SECRET_FILE", "SDP_IFACE", "SDP_LAUNCHER_ALLOW_FAKE_HOSTS"):
        env.pop(name, None)
    env.update(extra)
    return env


def _lines(out):
    """{rank: [lines]} from mpirun's --tag-output ``[JOB,RANK]<stdout>:`` pieces, each rank's
    pieces joined in order (mpirun tags every piece it forwards, not every line)."""
    parts = re.split(r"\[\d+,(\d+)\]<stdout>:", out)
    text = {}
    for rank, piece in zip(parts[1::2], parts[2::2]):
        text[int(rank)] = text.get(int(rank), "") + piece
    return {r: t.splitlines() for r, t in text.items()}


def _rows(out):
    """{rank: ROW dict}"""
    return {r: json.loads(ln[4:]) for r, lines in _lines(out).items() for ln in lines if ln.startswith("ROW ")}


def _check_rows(rows):
    assert sorted(rows) == [0, 1, 2, 3], rows
    for r, (local, cross, host) in EXPECTED.items():
        assert (rows[r]["size"], rows[r]["local"], rows[r]["cross"], rows[r]["host"]) == (4, local, cross, host)
        assert rows[r]["sdp_rank"] is None  # topology from OMPI_COMM_WORLD_*, not from sdprun
        assert rows[r]["secret_in_argv"] == [], f"rank {r}: the secret is on a command line"


def test_mpirun_argv():
    argv = mpi.mpirun_argv(hostlib.parse_hosts("h1:2,h2:2"), 4, ["python", "t.py"],
                           ["SDP_SECRET", "PATH", "SDP_SECRET"], SshOptions(port=2222, identity_file="/k"),
                           nic="eth0", mpirun="/usr/bin/mpirun", as_root=True)
    assert argv == ["/usr/bin/mpirun", "-np", "4", "-H", "h1:2,h2:2", "--bind-to", "none", "--map-by", "slot",
                    "--tag-output", "--allow-run-as-root", "-mca", "plm_rsh_agent", "ssh",
                    "-mca", "plm_rsh_args",
                    "-o BatchMode=yes -o ConnectTimeout=10 -p 2222 -i /k -o IdentitiesOnly=yes",
                    "-mca", "oob_tcp_if_include", "eth0", "-mca", "btl_tcp_if_include", "eth0",
                    "-x", "PATH", "-x", "SDP_SECRET", "python", "t.py"]
    assert "--allow-run-as-root" not in mpi.mpirun_argv([], 1, ["x"], [], as_root=False)


def test_sdprun_launcher_mpi(hosts):
    """sdprun --launcher mpi -np 4 -H h1:2,h2:2: one mpirun starts the ranks; allreduces are right,
    topology comes from Open MPI's variables, the secret is on no command line."""
    res = hosts.run("h1", [sys.executable, "-m", "sdp.launcher.cli", "--launcher", "mpi", "-np", "4",
                           "-H", "h1:2,h2:2", sys.executable, WORKER],
                    env=_env(), cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    _check_rows(_rows(res.stdout))


def test_plain_mpirun_rank0_serves_rendezvous(hosts):
    """A plain mpirun with -x MASTER_ADDR/MASTER_PORT and -x SDP_SECRET (no sdprun): rank 0 serves."""
    env = _env(SDP_SECRET="0123456789abcdef" * 4)
    res = hosts.run("h1", ["mpirun", "--allow-run-as-root", "--tag-output", "-np", "4", "-H", "h1:2,h2:2",
                           "--bind-to", "none", "-x", "PATH", "-x", "PYTHONPATH", "-x", "MASTER_ADDR=h1",
                           "-x", "MASTER_PORT=29511", "-x", "SDP_SECRET", sys.executable, WORKER],
                    env=env, cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    _check_rows(_rows(res.stdout))


def test_killed_rank_gives_peer_lost_and_leaves_nothing(hosts, tmp_path):
    """Rank 3 (on h2) killed with SIGKILL: ranks 0-2 raise PeerLostError naming it within 10 s,
    sdprun exits non-zero, no process of the job is left on h1 or h2."""
    marker = f"{WORKER} {tmp_path}"
    proc = hosts.popen("h1", [sys.executable, "-m", "sdp.launcher.cli", "--launcher", "mpi", "-np", "4",
                              "-H", "h1:2,h2:2", sys.executable, WORKER, str(tmp_path)],
                       env=_env(), cwd=REPO, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    ranks = replay.wait_fault_ranks(proc, tmp_path, 4)
    t0, out, err = replay.sigkill_and_wait(proc, ranks[3]["pid"], timeout_s=40)
    assert proc.returncode != 0, err
    lost = replay.lost_reports(_lines(out), t0)
    assert sorted(lost) == [0, 1, 2], out + err[-3000:]
    assert all(r == 3 and dt < 10 for r, dt in lost.values()), lost
    for h in ("h1", "h2"):
        left = hosts.wait_no_processes(h, match=marker, timeout_s=10)
        assert not left, f"processes left on {h}: {left}"

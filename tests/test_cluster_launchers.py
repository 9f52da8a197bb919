"""sdprun's --launcher choice and the mpirun / srun command lines, without the engines
(tests/test_mpirun.py and tests/test_slurm.py run them for real)."""
import io
import logging

import pytest

from sdp.launcher import cli, slurm


def _main(monkeypatch, argv, **env):
    """Run sdprun's main() with ``env`` as the environment; return (status, its log text)."""
    for k in [k for k in list(__import__("os").environ) if k.startswith("SLURM_")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger("sdp").addHandler(handler)
    try:
        return cli.main(argv), log.getvalue()
    finally:
        logging.getLogger("sdp").removeHandler(handler)


def test_srun_argv():
    assert slurm.srun_argv(4, ["python", "t.py"], srun="/usr/bin/srun") == \
        ["/usr/bin/srun", "--ntasks", "4", "--kill-on-bad-exit=1", "--quit-on-interrupt", "--label",
         "python", "t.py"]
    assert slurm.srun_argv(2, ["x"], nodes=2)[-3:] == ["--nodes", "2", "x"]


def test_allocation_helpers():
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2],m3", "SLURM_NTASKS": "6"}
    assert slurm.in_allocation(env) and not slurm.in_allocation({})
    assert slurm.allocation_nodes(env) == ["n1", "n2", "m3"] and slurm.allocation_nodes({}) == []
    assert slurm.default_ntasks(env) == 6 and slurm.default_ntasks({}) is None


def test_auto_is_slurm_inside_an_allocation(monkeypatch, tmp_path):
    # PATH without srun: the message names srun, so the slurm launcher was picked
    rc, log = _main(monkeypatch, ["-np", "2", "true"], SLURM_JOB_ID="5", PATH=str(tmp_path))
    assert rc == cli.EXIT_NOT_FOUND and "srun" in log, log
    rc, log = _main(monkeypatch, ["--launcher", "mpi", "-np", "2", "true"], PATH=str(tmp_path))
    assert rc == cli.EXIT_NOT_FOUND and "mpirun" in log and "openmpi-bin" in log, log


def test_auto_is_ssh_with_hosts_or_outside_an_allocation(monkeypatch, capfd):
    rc, _ = _main(monkeypatch, ["-np", "1", "-H", "localhost:1", "true"], SLURM_JOB_ID="5")
    assert rc == 0
    rc, _ = _main(monkeypatch, ["-np", "1", "true"])
    assert rc == 0


@pytest.mark.parametrize("argv, message", [
    (["--launcher", "slurm", "-H", "a:2", "-np", "2", "true"], "drop -H"),
    (["--launcher", "mpi", "-w", "-np", "2", "true"], "-w (elastic mode)"),
])
def test_launcher_usage_errors(monkeypatch, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        _main(monkeypatch, argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_slurm_needs_a_task_count(monkeypatch, tmp_path):
    (tmp_path / "srun").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "srun").chmod(0o755)
    rc, log = _main(monkeypatch, ["--launcher", "slurm", "true"], PATH=str(tmp_path), SLURM_JOB_ID="5")
    assert rc == cli.EXIT_USAGE and "-np" in log, log

"""Elastic resizing under ``sdprun -w``: the KungFu bridge's resize protocol and the launcher's
config server (tests/workers_kungfu_elastic.py is the worker; numpy only, so it is fast)."""
import collections
import json
import os
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request

import pytest

from sdp.launcher import cli, hosts
from sdp.launcher.elastic import ElasticController
from sdp.transport import security

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "workers_kungfu_elastic.py")


def _sdprun(*args, timeout=90):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.pop(cli.ALLOW_FAKE_HOSTS_ENV, None)
    return subprocess.run([sys.executable, "-m", "sdp.launcher.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def _records(stdout):
    out = []
    for line in stdout.splitlines():
        prefix, sep, rest = line.partition(":")
        if sep and prefix.endswith("<stdout>") and rest.startswith("{"):
            out.append(json.loads(rest))
    return out


def _check_run(res, initial, schedule, max_step):
    """Sizes follow the schedule, every step is done once per live worker, with identical weights,
    each worker's steps are consecutive, and the workers removed by a shrink detach cleanly."""
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    recs = _records(res.stdout)
    steps = [r for r in recs if "step" in r]
    expected, size = {}, initial
    for s in range(1, max_step + 1):
        expected[s] = size
        size = schedule.get(s, size)
    by_step = collections.defaultdict(list)
    for r in steps:
        by_step[r["step"]].append(r)
    assert sorted(by_step) == list(range(1, max_step + 1))
    for s, rows in by_step.items():
        assert len(rows) == expected[s], (s, rows)  # no lost or duplicated step
        assert {r["size"] for r in rows} == {expected[s]}
        assert sorted(r["rank"] for r in rows) == list(range(expected[s]))
        assert len({r["w"] for r in rows}) == 1, (s, rows)  # identical weights on all live workers
    per_worker = collections.defaultdict(list)
    for r in steps:
        per_worker[r["uid"]].append(r["step"])
    for seq in per_worker.values():
        assert seq == list(range(seq[0], seq[-1] + 1))  # monotonic, no gap, no repeat
    detached = [r for r in recs if "detached_at" in r]
    done = [r for r in recs if "done" in r]
    assert len(done) == expected[max_step] and all(r["done"] == max_step for r in done)
    assert len(per_worker) == len(done) + len(detached)
    return per_worker, detached


def test_resize_2_to_3_to_1():
    res = _sdprun("-w", "-np", "2", "-H", "localhost:3", "python", WORKER, '{"3": 3, "6": 1}', "9")
    per_worker, detached = _check_run(res, 2, {3: 3, 6: 1}, 9)
    assert len(per_worker) == 3 and sorted(r["detached_at"] for r in detached) == [6, 6]
    assert "resize: epoch 0 -> 1, 2 -> 3 workers" in res.stderr
    assert "resize: epoch 1 -> 2, 3 -> 1 workers" in res.stderr


def test_resize_from_config_server_with_kungfu_flags(tmp_path):
    # rank 0 proposes the size (PUT to the config server); every worker calls resize() each step
    res = _sdprun("-w", "-builtin-config-port", "0", "-q", "-logdir", str(tmp_path / "logs"), "-np", "1",
                  "-H", "localhost:3", "python", WORKER, '{"2": 3, "4": 2}', "6", "propose")
    per_worker, detached = _check_run(res, 1, {2: 3, 4: 2}, 6)
    assert len(per_worker) == 3 and [r["detached_at"] for r in detached] == [4]


def test_resize_2_to_3_to_1_tensorflow():
    pytest.importorskip("tensorflow")
    res = _sdprun("-w", "-np", "2", "-H", "localhost:3", "python", WORKER, '{"2": 3, "4": 1}', "6", "tf",
                  timeout=150)
    per_worker, detached = _check_run(res, 2, {2: 3, 4: 1}, 6)
    assert len(per_worker) == 3 and sorted(r["detached_at"] for r in detached) == [4, 4]


class _FakeGroup:
    def __init__(self):
        self.added = []

    def add(self, rank, env):
        self.added.append((rank, env))


SECRET = security.new_secret()


def _http(url, method="GET", body=None, secret=SECRET):
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if secret:
        headers["Authorization"] = security.http_authorization(secret, method, urllib.parse.urlsplit(url).path,
                                                               data or b"")
    req = urllib.request.Request(url, method=method, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def controller():
    group = _FakeGroup()
    ctl = ElasticController([hosts.HostSlots("localhost", 3)], group,
                            lambda infos, addr, epoch: [dict(i.env(), ADDR=addr, EPOCH=str(epoch)) for i in infos],
                            initial_size=2, start_timeout=5, secret=SECRET).start()
    yield ctl, group
    ctl.stop()


def test_config_server_endpoints(controller):
    ctl, group = controller
    assert ctl.worker_env() == {"SDP_ELASTIC_URL": ctl.url, "SDP_CONFIG_SERVER": ctl.url + "/config",
                                "SDP_ELASTIC_EPOCH": "0"}
    code, cfg = _http(ctl.url + "/config")
    assert code == 200 and cfg["size"] == 2 and cfg["version"] == 0 and len(cfg["workers"]) == 2
    code, cfg = _http(ctl.url + "/config", "PUT", {"Workers": ["a", "b", "c"]})  # KungFu style
    assert code == 200 and cfg["size"] == 3 and cfg["version"] == 1
    assert _http(ctl.url + "/config", "PUT", {"size": 4})[0] == 400  # more than the 3 slots
    assert _http(ctl.url + "/config", "PUT", {"nothing": 1})[0] == 400
    assert _http(ctl.url + "/nowhere")[0] == 404
    # KungFu's verbs: its Runners/Workers lists; PUT bumps the version even for the same size;
    # POST without a body resets to -np; DELETE clears (404 until written)
    code, cfg = _http(ctl.url + "/config")
    assert cfg["Runners"] == [{"Host": "localhost", "Slots": 3}] and [w["Rank"] for w in cfg["Workers"]] == [0, 1, 2]
    assert _http(ctl.url + "/config", "PUT", {"size": 3})[1]["version"] == 2
    code, cfg = _http(ctl.url + "/config", "POST")
    assert code == 200 and cfg["size"] == 2 and cfg["version"] == 3 and len(cfg["Workers"]) == 2
    assert _http(ctl.url + "/config", "DELETE") == (200, {"version": 4})
    assert _http(ctl.url + "/config")[0] == 404
    assert _http(ctl.url + "/config", "DELETE", secret=None)[0] == 401  # still signed
    code, cfg = _http(ctl.url + "/config", "PUT", {"Workers": [{}, {}, {}]})
    assert code == 200 and cfg["size"] == 3 and _http(ctl.url + "/config")[0] == 200
    # commit a grow: epoch 0 -> 1, one new worker (rank 2) with the new epoch's environment
    code, rec = _http(ctl.url + "/resize", "POST", {"size": 3, "epoch": 0})
    assert code == 200 and rec["epoch"] == 1 and rec["size"] == 3 and rec["rendezvous"].startswith("tcp://")
    assert [r["SDP_RANK"] for r in rec["ranks"]] == ["0", "1", "2"]
    assert [(r, e["SDP_SIZE"], e["EPOCH"]) for r, e in group.added] == [(2, "3", "1")]
    assert _http(ctl.url + "/resize", "POST", {"size": 3, "epoch": 0})[1] == rec  # a retry
    code, err = _http(ctl.url + "/resize", "POST", {"size": 1, "epoch": 0})
    assert code == 409 and "epoch" in err["error"]
    assert _http(ctl.url + "/resize", "POST", {"size": 5, "epoch": 1})[0] == 400
    code, rec = _http(ctl.url + "/resize", "POST", {"size": 1, "epoch": 1})  # shrink: nobody new
    assert code == 200 and rec["epoch"] == 2 and len(group.added) == 1
    assert _http(ctl.url + "/status")[1] == {"epoch": 2, "size": 1, "capacity": 3, "desired": 1, "version": 6}


def test_parser_accepts_kungfu_elastic_flags():
    a = cli.build_parser().parse_args(["-q", "-logdir", "logs", "-np", "1", "-w", "-builtin-config-port", "9100",
                                       "-config-server", "http://127.0.0.1:9100/config", "python", "t.py"])
    assert a.watch and a.builtin_config_port == 9100 and a.config_server == "http://127.0.0.1:9100/config"
    a = cli.build_parser().parse_args(["--watch", "--builtin-config-port", "1", "--config-server", "u", "x"])
    assert a.watch and a.builtin_config_port == 1 and a.config_server == "u"


def test_quiet_flag_keeps_sdprun_to_warnings():
    """kungfu-run's -q: sdprun's INFO lines (elastic mode's config server...) are not printed."""
    loud = _sdprun("-w", "-builtin-config-port", "0", "-np", "1", "python", "-c", "print('hi')")
    quiet = _sdprun("-q", "-w", "-builtin-config-port", "0", "-np", "1", "python", "-c", "print('hi')")
    assert loud.returncode == 0 and quiet.returncode == 0, loud.stderr + quiet.stderr
    assert "sdprun INFO: elastic mode" in loud.stderr
    assert "sdprun INFO" not in quiet.stderr and "[0]<stdout>:hi" in quiet.stdout


def test_logdir_writes_each_workers_output(tmp_path):
    """kungfu-run's -logdir: each worker's lines, unprefixed, in DIR/worker<K>.rank<R>.std{out,err}.log
    (and still on the terminal, prefixed)."""
    logdir = tmp_path / "logs"
    res = _sdprun("-logdir", str(logdir), "-np", "2", "python", "-c",
                  "import os, sys; r = os.environ['SDP_RANK']; print('out', r); print('err', r, file=sys.stderr)")
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in logdir.iterdir()) == [
        "worker0.rank0.stderr.log", "worker0.rank0.stdout.log", "worker1.rank1.stderr.log", "worker1.rank1.stdout.log"]
    for r in range(2):
        assert (logdir / f"worker{r}.rank{r}.stdout.log").read_text() == f"out {r}\n"
        assert f"err {r}\n" in (logdir / f"worker{r}.rank{r}.stderr.log").read_text()
        assert f"[{r}]<stdout>:out {r}" in res.stdout

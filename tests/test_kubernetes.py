"""examples/kubernetes/ (issue 16, item 3): the manifests (Indexed Job + headless Service; Kubeflow
TFJob) parse and are plausible Kubernetes
objects, and the exact environment each one gives a pod, replayed on emulated hosts (one process
per pod in its host's namespace, the pod DNS names of the headless Service resolving there through
``/etc/netns/NS/hosts``), forms the job.  Needs PyYAML; the replays need emulated hosts."""
import json
import os
import sys

import pytest

yaml = pytest.importorskip("yaml")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import emulated_hosts  # noqa: E402
import replay  # noqa: E402

REPO = replay.REPO
MANIFEST = os.path.join(REPO, "examples", "kubernetes", "mnist-indexed-job.yaml")
TFJOB = os.path.join(REPO, "examples", "kubernetes", "mnist-tfjob.yaml")
MNIST_DIR = os.environ.get("SDP_MNIST_DIR", os.path.join(os.path.dirname(REPO), "shared", "data", "mnist"))

pytestmark = pytest.mark.replay
needs_hosts = pytest.mark.skipif(emulated_hosts.unavailable_reason() is not None,
                                 reason=str(emulated_hosts.unavailable_reason()))


def _objects():
    with open(MANIFEST) as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    return {d["kind"]: d for d in docs}


def _container(job):
    return job["spec"]["template"]["spec"]["containers"][0]


def test_manifest_is_plausible_kubernetes():
    objs = _objects()
    assert sorted(objs) == ["Job", "Service"]
    svc, job = objs["Service"], objs["Job"]
    for obj, api in ((svc, "v1"), (job, "batch/v1")):
        assert obj["apiVersion"] == api and isinstance(obj["metadata"]["name"], str)
    name, svc_name = job["metadata"]["name"], svc["metadata"]["name"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in _container(job)["env"]}
    assert len(env) == len(_container(job)["env"]), "an env name is given twice"
    assert all(isinstance(v, str) for v in env.values()), "env values must be strings in Kubernetes"
    # Indexed Job: one pod per rank, all at once
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == int(env["WORLD_SIZE"])
    assert pod["restartPolicy"] in ("Never", "OnFailure")
    assert {"name", "image", "command"} <= set(_container(job))
    # headless Service that gives the pods their DNS names
    assert svc["spec"]["clusterIP"] == "None" and pod["subdomain"] == svc_name
    assert svc["spec"]["selector"] == {"job-name": name}
    assert int(env["MASTER_PORT"]) in [p["port"] for p in svc["spec"]["ports"]]
    assert env["MASTER_ADDR"] == f"{name}-0.{svc_name}"
    # the secret comes from a Kubernetes Secret mounted where SDP_SECRET_FILE points
    mounts = {m["name"]: m["mountPath"] for m in _container(job)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    secret_vols = [n for n, v in volumes.items() if "secret" in v]
    assert len(secret_vols) == 1 and volumes[secret_vols[0]]["secret"]["secretName"]
    assert os.path.dirname(env["SDP_SECRET_FILE"]) == mounts[secret_vols[0]]
    assert "SDP_SECRET" not in env


def pod_envs(secret_dir):
    """The environment of each pod of the Indexed Job: the container's env, JOB_COMPLETION_INDEX
    and HOSTNAME as Kubernetes sets them; the Secret's mount path mapped to ``secret_dir``."""
    objs = _objects()
    job, svc = objs["Job"], objs["Service"]
    container = _container(job)
    env = {e["name"]: e["value"] for e in container["env"]}
    mount = container["volumeMounts"][0]["mountPath"]
    env["SDP_SECRET_FILE"] = env["SDP_SECRET_FILE"].replace(mount, str(secret_dir), 1)
    name = job["metadata"]["name"]
    pods = []
    for i in range(job["spec"]["completions"]):
        pods.append(dict(env, JOB_COMPLETION_INDEX=str(i), HOSTNAME=f"{name}-{i}"))
    aliases = {f"h{i + 1}": [f"{name}-{i}.{svc['metadata']['name']}", f"{name}-{i}"]
               for i in range(len(pods))}
    return pods, aliases, container


@pytest.fixture
def pods(hosts, tmp_path):
    secret_dir = tmp_path / "secret"
    secret_dir.mkdir()
    (secret_dir / "secret").write_text(os.urandom(32).hex())  # what the Secret's key holds
    os.chmod(secret_dir / "secret", 0o400)
    envs, aliases, container = pod_envs(secret_dir)
    hosts.set_aliases(aliases)
    try:
        yield [(f"h{i + 1}", replay.base_env(**env)) for i, env in enumerate(envs)], container
    finally:
        hosts.set_aliases({})


@needs_hosts
def test_replayed_pods_form_the_job(hosts, pods):
    procs, _ = pods
    results = replay.run_processes(hosts, procs, replay.python_argv())
    rows = replay.rows_by_rank(results)
    assert sorted(rows) == [0, 1]
    for r in (0, 1):
        assert (rows[r]["size"], rows[r]["host"], rows[r]["source"], rows[r]["local"], rows[r]["cross"]) == \
            (2, f"h{r + 1}", "INDEXED_JOB", [0, 1], [r, 2])
        assert rows[r]["rendezvous"] == "tcp://sdp-mnist-0.sdp-mnist:29500"


@needs_hosts
@pytest.mark.slow
@pytest.mark.tf
@pytest.mark.skipif(not os.path.isdir(MNIST_DIR), reason=f"no MNIST data in {MNIST_DIR}")
@pytest.mark.skipif(os.environ.get("SDP_TEST_ACCEPTANCE") != "1",
                    reason="55 s of training that test_slurm.py's MNIST run already covers for the "
                           "engine; set SDP_TEST_ACCEPTANCE=1 to run the manifest's own command")
def test_replayed_pods_train_mnist(hosts, pods):
    """The manifest's own command (data directory mapped) in the replayed pods: accuracy >= 0.97,
    one weights checksum on both ranks (57 s here on 2 loaded cores)."""
    procs, container = pods
    argv = [sys.executable if a == "python" else MNIST_DIR if a == "/data/mnist" else a
            for a in container["command"]]
    results = replay.run_processes(hosts, procs, argv, timeout_s=500)
    sums, acc = set(), []
    for res in results:
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        sums |= {ln.split(":", 1)[1].strip() for ln in res.stdout.splitlines() if ln.startswith("weights checksum:")}
        acc += [float(ln.split(":")[1]) for ln in res.stdout.splitlines() if ln.startswith("test accuracy:")]
    assert len(sums) == 1, sums
    assert acc and min(acc) >= 0.97, acc


# ---------------------------------------------------------------- Kubeflow TFJob


def _tfjob():
    with open(TFJOB) as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    assert len(docs) == 1
    return docs[0]


def test_tfjob_is_plausible():
    job = _tfjob()
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "TFJob") and job["metadata"]["name"]
    replicas = job["spec"]["tfReplicaSpecs"]
    assert set(replicas) <= {"Chief", "Master", "Worker", "PS", "Evaluator"} and "PS" not in replicas
    worker = replicas["Worker"]
    assert worker["replicas"] >= 2 and worker["restartPolicy"] in ("Never", "OnFailure")
    container = worker["template"]["spec"]["containers"][0]
    assert container["name"] == "tensorflow"  # the operator's default container name
    assert {"tfjob-port": 2222} == {p["name"]: p["containerPort"] for p in container["ports"]}
    env = {e["name"]: e["value"] for e in container["env"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in worker["template"]["spec"]["volumes"]}
    assert os.path.dirname(env["SDP_SECRET_FILE"]) == mounts["sdp-secret"]
    assert volumes["sdp-secret"]["secret"]["secretName"] and "SDP_SECRET" not in env


@needs_hosts
def test_replayed_tfjob_pods_form_the_job(hosts, tmp_path):
    """Each worker pod's env as the training operator makes it (the manifest's env + TF_CONFIG with
    the per-pod Service names NAME-worker-I.NAMESPACE.svc:2222) on h1/h2: rank 0 serves at
    worker 0's host:port."""
    job = _tfjob()
    name, worker = job["metadata"]["name"], job["spec"]["tfReplicaSpecs"]["Worker"]
    container = worker["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    (tmp_path / "secret").write_text(os.urandom(32).hex())
    env["SDP_SECRET_FILE"] = str(tmp_path / "secret")  # the Secret's mount, mapped
    port = container["ports"][0]["containerPort"]
    names = [f"{name}-worker-{i}.default.svc" for i in range(worker["replicas"])]
    cluster = {"worker": [f"{n}:{port}" for n in names]}
    procs = [(f"h{i + 1}", replay.base_env(**env, TF_CONFIG=json.dumps(
        {"cluster": cluster, "task": {"type": "worker", "index": i}, "environment": "cloud"})))
        for i in range(len(names))]
    rows = replay.rows_by_rank(replay.run_processes(hosts, procs, replay.python_argv(),
                                                    aliases={f"h{i + 1}": [n] for i, n in enumerate(names)}))
    assert sorted(rows) == [0, 1]
    for r in (0, 1):
        assert (rows[r]["size"], rows[r]["host"], rows[r]["source"], rows[r]["rendezvous"]) == \
            (2, f"h{r + 1}", "TF_CONFIG", f"tcp://{names[0]}:{port}")

"""sdp.ray.RayExecutor on a real local 2-node Ray cluster (ray.cluster_utils.Cluster: a head
and a second raylet, 2 CPUs each), started once for this file.  Skipped without Ray
(``pip install "sdp[ray]"``)."""
import os
import time

import numpy as np
import psutil
import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from sdp.ray import RayExecutor  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster():
    # Ray pickles this file's functions by name: its workers must import this module (tests/).
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(os.path.abspath(__file__)), saved) if p)
    args = {"num_cpus": 2, "object_store_memory": 80 * 2**20}
    c = Cluster(initialize_head=True, head_node_args=dict(args, include_dashboard=False))
    c.add_node(**args)
    try:
        ray.init(address=c.address, log_to_driver=True)
        c.wait_for_nodes()
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def train(steps):
    """A training-shaped function: init, allreduce of per-rank values, the place of the rank."""
    import sdp
    if not sdp.is_initialized():
        sdp.init()
    total = None
    for step in range(steps):
        total = sdp.allreduce(np.full(1000, sdp.rank() + step, np.float32), op=sdp.Sum, name=f"s{step}")
    return {"rank": sdp.rank(), "size": sdp.size(), "local": (sdp.local_rank(), sdp.local_size()),
            "cross": (sdp.cross_rank(), sdp.cross_size()), "total": float(total[0])}


def test_run_returns_results_in_rank_order(cluster):
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=4, cpus_per_worker=1)
    executor.start()
    try:
        results = executor.run(train, args=[3])
        assert [r["rank"] for r in results] == [0, 1, 2, 3]
        assert all(r["size"] == 4 and r["total"] == 0 + 1 + 2 + 3 + 4 * 2 for r in results), results
        # PACK: 2 ranks on each of the 2 Ray nodes
        assert [r["local"] for r in results] == [(0, 2), (1, 2), (0, 2), (1, 2)]
        assert [r["cross"] for r in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]
        assert executor.execute(lambda executable: executable) == [None] * 4
        assert ray.get(executor.run_remote(lambda a, b=0: a + b, args=[1], kwargs={"b": 2})) == [3] * 4
        assert executor.execute_single(lambda _: __import__("os").environ["SDP_RANK"]) == "0"
    finally:
        executor.shutdown()


def horovod_style(x):
    """A function written for horovod.ray: Horovod's API, nothing of sdp's."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    hvd.init()
    hvd.init()  # Horovod: a second init() is a no-op
    return float(hvd.allreduce(tf.constant([x * (hvd.rank() + 1)], tf.float32), op=hvd.Sum)[0]), hvd.local_size()


@pytest.mark.tf
def test_horovod_style_function_under_compat(cluster):
    """With sdp.compat.install("horovod") in the driver, a Horovod-on-Ray function runs unmodified
    on the actors: allreduce of x*(rank+1) over 4 ranks = 10x on every rank."""
    pytest.importorskip("tensorflow")
    import sdp.compat
    sdp.compat.install("horovod")
    try:
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=4, cpus_per_worker=1)
        executor.start()
        try:
            assert executor.run(horovod_style, args=[1.5]) == [(15.0, 2)] * 4
        finally:
            executor.shutdown()
    finally:
        sdp.compat.uninstall("horovod")


def lose_peer(ready_dir):
    import time
    import sdp
    from sdp.common.errors import PeerLostError
    sdp.init()
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            sdp.allreduce(np.ones(100, np.float32), op=sdp.Sum, name="step")
            if not os.path.exists(os.path.join(ready_dir, str(sdp.rank()))):  # the job has formed, runs steps
                open(os.path.join(ready_dir, str(sdp.rank())), "w").close()
            time.sleep(0.01)
    except PeerLostError as e:
        return ("LOST", e.rank, time.time())
    return ("NOT LOST", None, time.time())


def test_dead_actor_gives_peer_lost(cluster, tmp_path):
    """ray.kill of rank 3's actor: ranks 0-2 return PeerLostError naming rank 3 within 10 s, rank 3's
    result raises RayActorError, and after shutdown no actor process is left."""
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=4)
    executor.start()
    pids = executor.run(os.getpid)
    try:
        refs = executor.run_remote(lose_peer, args=[str(tmp_path)])
        deadline = time.monotonic() + 60
        while len(os.listdir(tmp_path)) < 4:  # every rank has done a step
            assert time.monotonic() < deadline, f"ranks with a step done: {os.listdir(tmp_path)}"
            time.sleep(0.02)
        t0 = time.time()
        ray.kill(executor.workers[3])
        survivors = ray.get(refs[:3], timeout=30)
        assert [(s[0], s[1]) for s in survivors] == [("LOST", 3)] * 3, survivors
        assert all(s[2] - t0 < 10 for s in survivors), [s[2] - t0 for s in survivors]
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(refs[3], timeout=30)
    finally:
        executor.shutdown()
    deadline = time.monotonic() + 10
    while _running(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(pids), "actor processes left running"


def _running(pids):
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive

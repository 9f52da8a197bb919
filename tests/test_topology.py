"""Unit tests of sdp.common.topology: every environment family, with plain dicts (never os.environ)."""
import json
import socket

import pytest

from sdp.common.errors import TopologyError
from sdp.common.topology import (
    DEFAULT_RENDEZVOUS_PORT, SOURCES, Topology, expand_nodelist, expand_slurm_tasks_per_node, from_env,
    slurm_rendezvous_port)

MASTER = {"MASTER_ADDR": "node0", "MASTER_PORT": "1234"}


def layout(t: Topology):
    return (t.rank, t.size, t.local_rank, t.local_size, t.cross_rank, t.cross_size)


# ---------------------------------------------------------------------------------------------
# default and SDP


def test_empty_env_is_single_process():
    t = from_env({})
    assert layout(t) == (0, 1, 0, 1, 0, 1)
    assert t.source == "default"
    assert t.rendezvous_addr is None and t.serve_rendezvous is False
    assert t.hostname == socket.gethostname()


def test_sdp_full():
    env = {"SDP_RANK": "5", "SDP_SIZE": "8", "SDP_LOCAL_RANK": "1", "SDP_LOCAL_SIZE": "4",
           "SDP_CROSS_RANK": "1", "SDP_CROSS_SIZE": "2", "SDP_HOSTNAME": "h1",
           "SDP_RENDEZVOUS_ADDR": "tcp://10.0.0.1:5555"}
    t = from_env(env)
    assert layout(t) == (5, 8, 1, 4, 1, 2)
    assert (t.hostname, t.rendezvous_addr, t.serve_rendezvous, t.source) == (
        "h1", "tcp://10.0.0.1:5555", False, "SDP")


def test_sdp_defaults_are_literal():
    # SDP behaviour is unchanged: missing local/cross values are 0/1, no derivation.
    t = from_env({"SDP_RANK": "3", "SDP_SIZE": "4", "SDP_RENDEZVOUS_ADDR": "tcp://a:1"})
    assert layout(t) == (3, 4, 0, 1, 0, 1)
    assert t.serve_rendezvous is False


def test_sdp_ignores_master_addr():
    with pytest.raises(TopologyError, match="rendezvous"):
        from_env({"SDP_RANK": "0", "SDP_SIZE": "2", **MASTER})


def test_sdp_needs_both_rank_and_size():
    assert from_env({"SDP_RANK": "0"}).source == "default"


# ---------------------------------------------------------------------------------------------
# Horovod


HVD = {"HOROVOD_RANK": "6", "HOROVOD_SIZE": "8", "HOROVOD_LOCAL_RANK": "2", "HOROVOD_LOCAL_SIZE": "4",
       "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2"}


def test_horovod_with_master_addr():
    t = from_env({**HVD, **MASTER, "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.9.9.9",
                  "HOROVOD_GLOO_RENDEZVOUS_PORT": "4444"})
    assert layout(t) == (6, 8, 2, 4, 1, 2)
    assert t.source == "HOROVOD"
    assert (t.rendezvous_addr, t.serve_rendezvous) == ("tcp://node0:1234", True)


def test_horovod_sdp_rendezvous_addr_wins():
    t = from_env({**HVD, **MASTER, "SDP_RENDEZVOUS_ADDR": "tcp://rv:99", "SDP_JOB_ID": "j"})
    assert (t.rendezvous_addr, t.serve_rendezvous) == ("tcp://rv:99", False)  # a launcher of sdp serves it
    t = from_env({**HVD, **MASTER, "SDP_RENDEZVOUS_ADDR": "tcp://rv:99"})
    assert (t.rendezvous_addr, t.serve_rendezvous) == ("tcp://rv:99", True)  # the user's: rank 0 serves it


def test_horovod_gloo_rendezvous_is_not_ours():
    env = {**HVD, "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.9.9.9", "HOROVOD_GLOO_RENDEZVOUS_PORT": "4444"}
    with pytest.raises(TopologyError, match="MASTER_ADDR"):
        from_env(env)


def test_horovod_cross_derived_when_missing():
    env = {k: v for k, v in HVD.items() if "CROSS" not in k}
    t = from_env({**env, **MASTER})
    assert (t.cross_rank, t.cross_size) == (1, 2)


# ---------------------------------------------------------------------------------------------
# Open MPI


def test_ompi_derives_cross():
    env = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "12", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_NODE_RANK": "1", **MASTER}
    t = from_env(env)
    assert layout(t) == (5, 12, 1, 4, 1, 3)
    assert t.source == "OMPI"
    assert t.serve_rendezvous is True


def test_ompi_non_uniform_cross_unknown():
    env = {"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", **MASTER}
    t = from_env(env)
    assert (t.local_rank, t.local_size, t.cross_rank, t.cross_size) == (0, 2, 0, 1)


def test_ompi_without_local_means_one_process_per_host():
    t = from_env({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3", **MASTER})
    assert layout(t) == (2, 3, 0, 1, 2, 3)


# ---------------------------------------------------------------------------------------------
# PMI


def test_pmi():
    env = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", **MASTER}
    t = from_env(env)
    assert layout(t) == (3, 4, 1, 2, 1, 2)
    assert t.source == "PMI"


def test_pmi_local_rank_without_local_size_raises():
    env = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", **MASTER}
    with pytest.raises(TopologyError, match="MPI_LOCALNRANKS"):
        from_env(env)


def test_local_size_without_local_rank_raises():
    env = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "2", **MASTER}
    with pytest.raises(TopologyError, match="MPI_LOCALRANKID"):
        from_env(env)


def test_local_size_one_without_local_rank_is_fine():
    env = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "1", **MASTER}
    assert layout(from_env(env)) == (3, 4, 0, 1, 3, 4)


# ---------------------------------------------------------------------------------------------
# Slurm


def slurm(**kw):
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", **MASTER}
    env.update({f"SLURM_{k}": str(v) for k, v in kw.items()})
    return env


@pytest.mark.parametrize("value, expected", [
    ("4", [4]),
    ("4(x2)", [4, 4]),
    ("2,1", [2, 1]),
    ("2(x3),1", [2, 2, 2, 1]),
    ("1,3(x2),2", [1, 3, 3, 2]),
])
def test_expand_slurm_tasks_per_node(value, expected):
    assert expand_slurm_tasks_per_node(value) == expected


@pytest.mark.parametrize("value", ["", "x", "4(x)", "4(2)", "0", "2(x0)", "2,,1", "-1", "1.5"])
def test_expand_slurm_tasks_per_node_rejects(value):
    with pytest.raises(TopologyError, match="SLURM_TASKS_PER_NODE"):
        expand_slurm_tasks_per_node(value)


def test_slurm_uniform_plain_count():
    env = slurm(PROCID=5, NTASKS=8, LOCALID=1, NODEID=1, NNODES=2, NTASKS_PER_NODE=4)
    t = from_env(env)
    assert layout(t) == (5, 8, 1, 4, 1, 2)
    assert t.source == "SLURM"


def test_slurm_uniform_plain_count_without_nnodes():
    env = slurm(PROCID=5, NTASKS=8, LOCALID=1, NODEID=1, NTASKS_PER_NODE=4)
    assert layout(from_env(env)) == (5, 8, 1, 4, 1, 2)


def test_slurm_uniform_repeat_format():
    env = slurm(PROCID=7, NTASKS=8, LOCALID=3, NODEID=1, NNODES=2, TASKS_PER_NODE="4(x2)")
    assert layout(from_env(env)) == (7, 8, 3, 4, 1, 2)


def test_slurm_cross_is_node_id_under_cyclic_distribution():
    # Cyclic distribution: rank 1 is on node 1; the cross rank comes from SLURM_NODEID, not rank.
    env = slurm(PROCID=1, NTASKS=4, LOCALID=0, NODEID=1, NNODES=2, TASKS_PER_NODE="2(x2)")
    assert layout(from_env(env)) == (1, 4, 0, 2, 1, 2)


def test_slurm_non_uniform_horovod_style_cross():
    # Nodes have 2, 1 and 2 tasks.  Local rank 1 exists on nodes 0 and 2 only.
    base = dict(NTASKS=5, NNODES=3, TASKS_PER_NODE="2,1,2")
    t = from_env(slurm(PROCID=4, LOCALID=1, NODEID=2, **base))
    assert layout(t) == (4, 5, 1, 2, 1, 2)
    t = from_env(slurm(PROCID=2, LOCALID=0, NODEID=1, **base))
    assert layout(t) == (2, 5, 0, 1, 1, 3)
    t = from_env(slurm(PROCID=3, LOCALID=0, NODEID=2, **base))
    assert layout(t) == (3, 5, 0, 2, 2, 3)


def test_slurm_step_values_preferred():
    env = slurm(PROCID=1, NTASKS=8, STEP_NUM_TASKS=2, LOCALID=1, NODEID=0, NNODES=2,
                STEP_NUM_NODES=1, TASKS_PER_NODE="4(x2)", STEP_TASKS_PER_NODE="2")
    assert layout(from_env(env)) == (1, 2, 1, 2, 0, 1)


def test_slurm_without_tasks_per_node_assumes_uniform():
    env = slurm(PROCID=3, NTASKS=4, LOCALID=1, NODEID=1, NNODES=2)
    assert layout(from_env(env)) == (3, 4, 1, 2, 1, 2)


def test_slurm_inconsistent_tasks_per_node():
    with pytest.raises(TopologyError, match="adds up to"):
        from_env(slurm(PROCID=0, NTASKS=5, NNODES=2, TASKS_PER_NODE="2(x2)"))
    with pytest.raises(TopologyError, match="describes 3 nodes"):
        from_env(slurm(PROCID=0, NTASKS=5, NNODES=2, TASKS_PER_NODE="2,2,1"))
    with pytest.raises(TopologyError, match="SLURM_NODEID=3"):
        from_env(slurm(PROCID=0, NTASKS=4, NODEID=3, NNODES=2, TASKS_PER_NODE="2(x2)"))


def test_slurm_bad_tasks_per_node_names_variable():
    with pytest.raises(TopologyError, match="SLURM_NTASKS_PER_NODE"):
        from_env(slurm(PROCID=0, NTASKS=4, NTASKS_PER_NODE="four"))


@pytest.mark.parametrize("value, expected", [
    ("n1", ["n1"]),
    ("n[1-3,7],gpu05", ["n1", "n2", "n3", "n7", "gpu05"]),
    ("node[08-10]", ["node08", "node09", "node10"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
])
def test_expand_nodelist(value, expected):
    assert expand_nodelist(value) == expected


@pytest.mark.parametrize("value", ["", "n[3-1]", "n[1-2", "n]"])
def test_expand_nodelist_rejects(value):
    with pytest.raises(TopologyError, match="SLURM_STEP_NODELIST"):
        expand_nodelist(value, "SLURM_STEP_NODELIST")


def plain_srun(**kw):
    """What srun gives task 3 of `srun -N 2 --ntasks-per-node 2` in job 4711 (no MASTER_ADDR)."""
    env = {"SLURM_JOB_ID": "4711", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
           "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
           "SLURM_STEP_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[07-08]",
           "SLURM_STEP_NODELIST": "node[07-08]", "SLURM_TASKS_PER_NODE": "2(x2)",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    env.update(kw)
    return env


def test_slurm_plain_srun_rendezvous_on_first_node_at_job_port():
    t = from_env(plain_srun())
    assert layout(t) == (3, 4, 1, 2, 1, 2)
    port = slurm_rendezvous_port(4711, 0)
    assert port == 20000 + 4711 * 7 % 10000
    assert (t.rendezvous_addr, t.serve_rendezvous) == (f"tcp://node07:{port}", True)


def test_slurm_steps_and_jobs_get_different_ports():
    ports = {slurm_rendezvous_port(job, step) for job in range(1000, 1100) for step in range(7)}
    assert len(ports) == 700 and all(20000 <= p < 30000 for p in ports)
    t = from_env(plain_srun(SLURM_STEP_ID="3", SLURM_STEP_NODELIST="node08"))  # a later step
    assert t.rendezvous_addr == f"tcp://node08:{slurm_rendezvous_port(4711, 3)}"


def test_slurm_rendezvous_overrides():
    t = from_env(plain_srun(SDP_RENDEZVOUS_ADDR="tcp://10.1.1.1:99", SDP_JOB_ID="j"))
    assert (t.rendezvous_addr, t.serve_rendezvous) == ("tcp://10.1.1.1:99", False)
    t = from_env(plain_srun(SDP_RENDEZVOUS_ADDR="tcp://10.1.1.1:99"))
    assert (t.rendezvous_addr, t.serve_rendezvous) == ("tcp://10.1.1.1:99", True)
    assert from_env(plain_srun(MASTER_ADDR="head", MASTER_PORT="5")).rendezvous_addr == "tcp://head:5"
    assert from_env(plain_srun(MASTER_PORT="5")).rendezvous_addr == "tcp://node07:5"
    env = plain_srun()
    del env["SLURM_STEP_NODELIST"]
    assert from_env(env).rendezvous_addr.startswith("tcp://node07:")  # the job's node list


def test_slurm_bad_nodelist_names_variable():
    with pytest.raises(TopologyError, match="SLURM_STEP_NODELIST"):
        from_env(plain_srun(SLURM_STEP_NODELIST="node[08-07]"))


def test_slurm_single_task():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
           "SLURM_TASKS_PER_NODE": "1"}
    t = from_env(env)
    assert layout(t) == (0, 1, 0, 1, 0, 1)
    assert t.rendezvous_addr is None and t.source == "SLURM"


# ---------------------------------------------------------------------------------------------
# SageMaker


SM = {"SM_HOSTS": json.dumps(["algo-2", "algo-1", "algo-3"]), "SM_CURRENT_HOST": "algo-2"}


def test_sagemaker_one_process_per_host():
    t = from_env(SM)
    assert layout(t) == (1, 3, 0, 1, 1, 3)
    assert t.source == "SAGEMAKER"
    assert (t.rendezvous_addr, t.serve_rendezvous) == (f"tcp://algo-1:{DEFAULT_RENDEZVOUS_PORT}", True)


def test_sagemaker_master_overrides():
    t = from_env({**SM, **MASTER})
    assert t.rendezvous_addr == "tcp://node0:1234"
    t = from_env({**SM, "MASTER_PORT": "777"})
    assert t.rendezvous_addr == "tcp://algo-1:777"
    t = from_env({**SM, "SDP_RENDEZVOUS_ADDR": "tcp://x:1", "SDP_JOB_ID": "j"})
    assert (t.rendezvous_addr, t.serve_rendezvous) == ("tcp://x:1", False)


@pytest.mark.parametrize("hosts, current, match", [
    ("not json", "algo-1", "SM_HOSTS"),
    ('{"a": 1}', "algo-1", "SM_HOSTS"),
    ("[]", "algo-1", "SM_HOSTS"),
    ('["algo-1", "algo-1"]', "algo-1", "twice"),
    ('["algo-1", "algo-2"]', "algo-9", "SM_CURRENT_HOST"),
])
def test_sagemaker_bad_values(hosts, current, match):
    with pytest.raises(TopologyError, match=match):
        from_env({"SM_HOSTS": hosts, "SM_CURRENT_HOST": current})


def test_sagemaker_needs_current_host():
    assert from_env({"SM_HOSTS": '["algo-1", "algo-2"]'}).source == "default"


def test_sagemaker_mpi_launch_uses_mpi_variables():
    # SageMaker's own MPI launch sets OMPI_* too; those give the per-process ranks.
    env = {**SM, "OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_SIZE": "24",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "8", **MASTER}
    t = from_env(env)
    assert t.source == "OMPI" and layout(t) == (9, 24, 1, 8, 1, 3)


# ---------------------------------------------------------------------------------------------
# torchrun / Kubernetes


def test_torchrun():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
           "GROUP_WORLD_SIZE": "2", **MASTER}
    t = from_env(env)
    assert layout(t) == (5, 8, 1, 4, 1, 2)
    assert t.source == "TORCHRUN"
    assert (t.rendezvous_addr, t.serve_rendezvous) == ("tcp://node0:1234", True)


def test_torchrun_group_rank_only():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
           **MASTER}
    assert layout(from_env(env)) == (5, 8, 1, 4, 1, 2)


def test_torchrun_agent_store_moves_port():
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
           "TORCHELASTIC_USE_AGENT_STORE": "True", **MASTER}
    assert from_env(env).rendezvous_addr == "tcp://node0:1235"


def test_kubernetes_style_one_pod_per_rank_default_port():
    t = from_env({"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "job-master-0"})
    assert layout(t) == (2, 4, 0, 1, 2, 4)
    assert t.rendezvous_addr == f"tcp://job-master-0:{DEFAULT_RENDEZVOUS_PORT}"


def test_ipv6_master_addr_is_bracketed():
    t = from_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "fd00::1", "MASTER_PORT": "5"})
    assert t.rendezvous_addr == "tcp://[fd00::1]:5"


def test_pytorchjob_master_and_workers():
    # Kubeflow's PyTorchJob gives every pod MASTER_ADDR (the master replica's Service),
    # MASTER_PORT, WORLD_SIZE and RANK (master 0, workers 1..).
    env = {"MASTER_ADDR": "mnist-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2",
           "PYTHONUNBUFFERED": "0"}
    t = from_env(env)
    assert layout(t) == (2, 3, 0, 1, 2, 3) and t.source == "TORCHRUN"
    assert (t.rendezvous_addr, t.serve_rendezvous) == ("tcp://mnist-master-0:23456", True)
    assert t.assumed == ("local", "cross")


def tf_config(kind, index, **cluster):
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})}


def test_tf_config_chief_then_workers():
    cluster = dict(chief=["job-chief-0.job:2222"], worker=["job-worker-0.job:2222", "job-worker-1.job:2222"],
                   ps=["job-ps-0.job:2222"])
    for (kind, index), rank in {("chief", 0): 0, ("worker", 0): 1, ("worker", 1): 2}.items():
        t = from_env(tf_config(kind, index, **cluster))
        assert layout(t) == (rank, 3, 0, 1, rank, 3) and t.source == "TF_CONFIG"
        assert (t.rendezvous_addr, t.serve_rendezvous) == ("tcp://job-chief-0.job:2222", True)
    t = from_env({**tf_config("worker", 1, **cluster), "SDP_RENDEZVOUS_ADDR": "tcp://x:1", "SDP_JOB_ID": "j"})
    assert (t.rendezvous_addr, t.serve_rendezvous) == ("tcp://x:1", False)


def test_tf_config_workers_only_and_ipv6():
    t = from_env(tf_config("worker", 1, worker=["[fd00::1]:2222", "[fd00::2]:2222"]))
    assert layout(t) == (1, 2, 0, 1, 1, 2)
    assert t.rendezvous_addr == "tcp://[fd00::1]:2222"


@pytest.mark.parametrize("value, match", [
    ("{", "not a TF_CONFIG"),
    (json.dumps({"cluster": {"worker": ["a:1"]}}), "not a TF_CONFIG"),
    (json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": "0"}}), "not a TF_CONFIG"),
    (json.dumps({"cluster": {"worker": ["a:1"], "ps": ["p:1"]}, "task": {"type": "ps", "index": 0}}),
     "'ps' has no rank"),
    (json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 1}}), "worker 1"),
    (json.dumps({"cluster": {"worker": ["a"]}, "task": {"type": "worker", "index": 0}}), "host:port"),
])
def test_tf_config_bad_values(value, match):
    with pytest.raises(TopologyError, match=match):
        from_env({"TF_CONFIG": value})


def test_indexed_job():
    env = {"JOB_COMPLETION_INDEX": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "sdp-mnist-0.sdp-mnist",
           "MASTER_PORT": "29500"}
    t = from_env(env)
    assert layout(t) == (1, 2, 0, 1, 1, 2) and t.source == "INDEXED_JOB"
    assert (t.rendezvous_addr, t.serve_rendezvous) == ("tcp://sdp-mnist-0.sdp-mnist:29500", True)
    with pytest.raises(TopologyError, match="INDEXED_JOB.*MASTER_ADDR"):
        from_env({"JOB_COMPLETION_INDEX": "1", "WORLD_SIZE": "2"})
    with pytest.raises(TopologyError, match="rank 2 is outside"):
        from_env({**env, "JOB_COMPLETION_INDEX": "2"})


def test_torchrun_local_rank_without_local_size_raises():
    # e.g. the legacy torch.distributed.launch, which sets no LOCAL_WORLD_SIZE
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", **MASTER}
    with pytest.raises(TopologyError, match="LOCAL_WORLD_SIZE"):
        from_env(env)


# ---------------------------------------------------------------------------------------------
# precedence


ALL = {
    "SDP": {"SDP_RANK": "0", "SDP_SIZE": "2", "SDP_RENDEZVOUS_ADDR": "tcp://sdp:1"},
    "HOROVOD": {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "3"},
    "OMPI": {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"},
    "PMI": {"PMI_RANK": "3", "PMI_SIZE": "5"},
    "SLURM": {"SLURM_PROCID": "4", "SLURM_NTASKS": "6"},
    "SAGEMAKER": {"SM_HOSTS": '["a", "b", "c", "d", "e", "f", "g"]', "SM_CURRENT_HOST": "f"},
    "TF_CONFIG": {"TF_CONFIG": json.dumps({"cluster": {"worker": [f"w{i}:2222" for i in range(8)]},
                                           "task": {"type": "worker", "index": 6}})},
    "TORCHRUN": {"RANK": "7", "WORLD_SIZE": "10"},
    "INDEXED_JOB": {"JOB_COMPLETION_INDEX": "8", "WORLD_SIZE": "10"},
}


@pytest.mark.parametrize("first", range(len(ALL)))
def test_precedence(first):
    names = list(ALL)
    env = {**MASTER}
    for name in names[first:]:
        env.update(ALL[name])
    t = from_env(env)
    assert t.source == names[first]
    assert t.rank == first and t.size >= first + 2  # (TORCHRUN and INDEXED_JOB share WORLD_SIZE)


def test_sources_order():
    assert SOURCES == ("SDP", "HOROVOD", "OMPI", "PMI", "SLURM", "SAGEMAKER", "TF_CONFIG", "TORCHRUN",
                       "INDEXED_JOB", "default")


# ---------------------------------------------------------------------------------------------
# bad values and common rules


@pytest.mark.parametrize("env, var", [
    ({"SDP_RANK": "x", "SDP_SIZE": "2"}, "SDP_RANK"),
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "two"}, "HOROVOD_SIZE"),
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_CROSS_RANK": "?"}, "HOROVOD_CROSS_RANK"),
    ({"OMPI_COMM_WORLD_RANK": "1.0", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_RANK"),
    ({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": ""}, "MPI_LOCALRANKID"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODEID": "a"}, "SLURM_NODEID"),
    ({"RANK": "0", "WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "n"}, "GROUP_WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "http"}, "MASTER_PORT"),
])
def test_non_integer_names_variable(env, var):
    env = {**MASTER, **env} if "MASTER_PORT" not in env else env
    with pytest.raises(TopologyError, match=var):
        from_env(env)


@pytest.mark.parametrize("env", [
    {"SDP_RANK": "2", "SDP_SIZE": "2", "SDP_RENDEZVOUS_ADDR": "tcp://a:1"},
    {"HOROVOD_RANK": "2", "HOROVOD_SIZE": "2", **MASTER},
    {"OMPI_COMM_WORLD_RANK": "-1", "OMPI_COMM_WORLD_SIZE": "2", **MASTER},
    {"PMI_RANK": "0", "PMI_SIZE": "0"},
    {"SLURM_PROCID": "4", "SLURM_NTASKS": "4", **MASTER},
    {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2", **MASTER},
    {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "2",
     "HOROVOD_CROSS_RANK": "2", "HOROVOD_CROSS_SIZE": "2", **MASTER},
    {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
     "OMPI_COMM_WORLD_LOCAL_SIZE": "4", **MASTER},
    {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"},
])
def test_impossible_topology_raises(env):
    with pytest.raises(TopologyError):
        from_env(env)


@pytest.mark.parametrize("env", [
    {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"},
    {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"},
    {"PMI_RANK": "0", "PMI_SIZE": "2"},
    {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"},
    {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1234"},
])
def test_size_above_one_without_rendezvous_raises(env):
    with pytest.raises(TopologyError, match="SDP_RENDEZVOUS_ADDR"):
        from_env(env)


def test_size_one_needs_no_rendezvous():
    t = from_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"})
    assert layout(t) == (0, 1, 0, 1, 0, 1)
    assert (t.rendezvous_addr, t.serve_rendezvous, t.source) == (None, False, "OMPI")


def test_hostname_override():
    t = from_env({"PMI_RANK": "0", "PMI_SIZE": "2", "SDP_HOSTNAME": "myhost", **MASTER})
    assert t.hostname == "myhost"
    t = from_env({"PMI_RANK": "0", "PMI_SIZE": "2", **MASTER})
    assert t.hostname == socket.gethostname()


def test_env_not_modified():
    env = {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True", **MASTER}
    before = dict(env)
    from_env(env)
    assert env == before


def test_topology_is_frozen():
    t = from_env({})
    with pytest.raises(Exception):
        t.rank = 3  # type: ignore[misc]


# -- values computed from the host names met at rendezvous ------------------------------------

def test_assumed_values_are_recorded():
    assert from_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
                     "MASTER_ADDR": "h"}).assumed == ("local", "cross")
    assert from_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                     "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "h"}).assumed == ("cross",)
    assert from_env({"SDP_RANK": "1", "SDP_SIZE": "4", "SDP_RENDEZVOUS_ADDR": "tcp://h:1"}).assumed == ()


@pytest.mark.parametrize("hosts, rank, expect", [
    (["a", "b", "a", "b"], 2, (1, 2, 0, 2)),  # round robin: rank 2 is a's second process
    (["a", "b", "a", "b"], 1, (0, 2, 1, 2)),
    (["a", "a", "a", "b"], 3, (0, 1, 1, 2)),  # uneven: local rank 0 exists on both hosts
    (["a", "a", "a", "b"], 2, (2, 3, 0, 1)),  # local rank 2 only on host a
    (["x", "y", "z"], 2, (0, 1, 2, 3)),
])
def test_with_hosts_computes_local_and_cross(hosts, rank, expect):
    topo = from_env({"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(len(hosts)),
                     "MASTER_ADDR": "h"}).with_hosts(hosts)
    assert (topo.local_rank, topo.local_size, topo.cross_rank, topo.cross_size) == expect
    assert topo.assumed == ()


def test_with_hosts_keeps_what_the_launcher_gave():
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "h"}
    topo = from_env(env)
    assert (topo.cross_rank, topo.cross_size) == (1, 2)  # contiguous placement assumed
    placed = topo.with_hosts(["a", "b", "b", "a"])  # rank 2 is b's second process...
    assert (placed.local_rank, placed.local_size) == (0, 2)  # ...but the launcher said local rank 0
    assert (placed.cross_rank, placed.cross_size) == (0, 2)  # by host, ranks 2 and 3 are local rank 1
    sdp_topo = from_env({"SDP_RANK": "1", "SDP_SIZE": "2", "SDP_RENDEZVOUS_ADDR": "tcp://h:1"})
    assert sdp_topo.with_hosts(["a", "b"]) is sdp_topo


def test_mpirun_style_round_robin_placement_gets_local_and_cross_from_hosts():
    """4 ranks from Open MPI variables alone (no local/cross), placed round robin on two
    "hosts" (SDP_HOSTNAME): init() computes the values from the host names at rendezvous."""
    from harness import check_ok, run_workers
    sdp_vars = ["SDP_RANK", "SDP_SIZE", "SDP_LOCAL_RANK", "SDP_LOCAL_SIZE", "SDP_CROSS_RANK", "SDP_CROSS_SIZE"]

    def env(r):
        return dict({k: None for k in sdp_vars}, OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE="4",
                    SDP_HOSTNAME="ab"[r % 2])

    values = check_ok(run_workers(4, "workers_collectives:topology_values", [], per_rank_env=env))
    assert values == [[0, 2, 0, 2, 4.0], [0, 2, 1, 2, 4.0], [1, 2, 0, 2, 4.0], [1, 2, 1, 2, 4.0]]

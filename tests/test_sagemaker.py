"""SageMaker (issue 16, item 5): the environment SageMaker's training toolkit gives the two
instances of a 2-instance script-mode job, replayed on emulated hosts h1/h2 named ``algo-1`` /
``algo-2`` (as SageMaker's DNS names them), forms the job: one rank per instance, rank = index of
``SM_CURRENT_HOST`` in the sorted ``SM_HOSTS``, rank 0 serving the rendezvous at
``algo-1:29500``, the secret from ``SDP_SECRET`` (the estimator's ``environment=``)."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import emulated_hosts  # noqa: E402
import replay  # noqa: E402

pytestmark = [pytest.mark.replay,
              pytest.mark.skipif(emulated_hosts.unavailable_reason() is not None,
                                 reason=str(emulated_hosts.unavailable_reason()))]

HOSTS = ["algo-1", "algo-2"]


def instance_env(current, secret):
    """What sagemaker-training sets for ``current`` (the variables sdp could read, and some it
    must ignore), plus the estimator's environment."""
    resource = {"current_host": current, "current_instance_type": "ml.c5.xlarge", "hosts": HOSTS,
                "network_interface_name": "eth0"}
    return {
        "SM_HOSTS": json.dumps(HOSTS), "SM_CURRENT_HOST": current, "SM_NUM_CPUS": "2", "SM_NUM_GPUS": "0",
        "SM_NETWORK_INTERFACE_NAME": "eth0", "SM_RESOURCE_CONFIG": json.dumps(resource),
        "SM_MODEL_DIR": "/opt/ml/model", "SM_OUTPUT_DATA_DIR": "/opt/ml/output/data",
        "SM_CHANNELS": '["training"]', "SM_CHANNEL_TRAINING": "/opt/ml/input/data/training",
        "SM_HPS": '{"epochs": 1}', "SM_HP_EPOCHS": "1", "SM_USER_ENTRY_POINT": "train.py",
        "SM_FRAMEWORK_MODULE": "sagemaker_tensorflow_container.training:main",
        "SAGEMAKER_REGION": "us-east-1", "TRAINING_JOB_NAME": "sdp-mnist-2026-11-24",
        "SDP_SECRET": secret,  # estimator = TensorFlow(..., environment={"SDP_SECRET": ...})
    }


def test_replayed_instances_form_the_job(hosts):
    secret = os.urandom(32).hex()
    # listed in reverse: the rank comes from the sorted SM_HOSTS, not from the start order
    procs = [("h2", replay.base_env(**instance_env("algo-2", secret))),
             ("h1", replay.base_env(**instance_env("algo-1", secret)))]
    rows = replay.rows_by_rank(replay.run_processes(hosts, procs, replay.python_argv(),
                                                    aliases={"h1": ["algo-1"], "h2": ["algo-2"]}))
    assert sorted(rows) == [0, 1]
    for r in (0, 1):
        assert (rows[r]["size"], rows[r]["host"], rows[r]["source"], rows[r]["local"], rows[r]["cross"],
                rows[r]["rendezvous"]) == (2, f"h{r + 1}", "SAGEMAKER", [0, 1], [r, 2], "tcp://algo-1:29500")

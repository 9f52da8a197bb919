"""sdp.tensorflow.threads: TensorFlow's thread spinning is off when a host runs several ranks
(each test runs in a fresh interpreter: TensorFlow's runtime is made once per process)."""
import json
import os
import subprocess
import sys

import pytest

CHECK = """
import json, sys
from tensorflow.python.eager import context
import tensorflow as tf
from sdp.tensorflow import threads
if {initialize_first}:
    tf.constant(1.0) + 1.0  # the runtime and its thread pools exist from here on
applied = threads.configure({local_size})
tf.constant(1.0) + 1.0
print(json.dumps([applied, context.context().config.experimental.disable_thread_spinning]))
"""


def configure(local_size, initialize_first=False, spinning=None):
    env = dict(os.environ)
    env.pop("SDP_TF_THREAD_SPINNING", None)
    if spinning is not None:
        env["SDP_TF_THREAD_SPINNING"] = spinning
    code = CHECK.format(local_size=local_size, initialize_first=initialize_first)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("local_size,spinning,want", [
    (2, None, [True, True]),     # several ranks share the cores: no spinning
    (1, None, [False, False]),   # one rank per host: TensorFlow's default
    (4, "1", [False, False]),    # the user keeps spinning
])
def test_spinning_is_off_only_when_ranks_share_a_host(local_size, spinning, want):
    assert configure(local_size, spinning=spinning) == want


def test_a_bad_value_is_a_clear_error():
    with pytest.raises(AssertionError, match=r"ValueError: environment variable SDP_TF_THREAD_SPINNING='maybe': expected 0 or 1"):
        configure(2, spinning="maybe")


def test_after_tensorflow_started_nothing_changes():
    assert configure(2, initialize_first=True) == [False, False]

"""Elastic KungFu-style MNIST training on sdp: the cluster grows and shrinks on a step schedule.

    sdprun -w -np 2 -H localhost:4 python examples/kungfu_elastic_mnist.py \\
        --data-dir ../shared/data/mnist --schedule 100:4,200:2 --max-step 300

With ``-w`` (watch mode) ``sdprun`` serves a config server and starts new workers when the
cluster grows.  The loop follows KungFu's elastic pattern:

* after step ``s`` in the schedule, every worker calls ``resize(n)``: it returns
  ``(changed, detached)``; a detached worker (rank >= n) leaves the loop and exits;
* after a change, and when a new worker starts, everybody re-synchronises from rank 0: the step
  counter first (so no step is lost or repeated), then the model and optimizer variables.

Each worker trains on batches drawn for (step, rank), so the data is spread over however many
workers there are.  Rank 0 evaluates on the test set at the end.
"""
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.append(str(_HERE.parent))

import common  # noqa: E402  (helpers shared by the examples; no TensorFlow yet: --help answers at once)


def parse_schedule(text):
    """'100:4,200:2' -> {100: 4, 200: 2}: after step 100 resize to 4 workers, after 200 to 2."""
    out = {}
    for item in filter(None, text.split(",")):
        step, size = item.split(":")
        out[int(step)] = int(size)
    return out


def parse_args(argv=None):
    p = common.argument_parser(__doc__)
    # --data-dir, --batch-size, --lr
    common.add_common_args(p, epochs=None, batch_size=64, lr=0.002, seed=None, per="worker")
    p.add_argument("--schedule", default="100:4,200:2", help="STEP:SIZE,... resize after STEP to SIZE")
    p.add_argument("--max-step", type=int, default=300, help="train until this step")
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and flag errors before TensorFlow loads (5-20 s)

import os  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import mnist_data  # noqa: E402
from sdp_kungfu_bridge.python import (current_cluster_size, current_rank, resize,  # noqa: E402
                                      run_barrier)
from sdp_kungfu_bridge.tensorflow.initializer import broadcast_variables  # noqa: E402
from sdp_kungfu_bridge.tensorflow.ops import broadcast  # noqa: E402
from sdp_kungfu_bridge.tensorflow.optimizers import SynchronousSGDOptimizer  # noqa: E402


def main():
    args = parse_args()
    schedule = parse_schedule(args.schedule)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.keras.utils.set_random_seed(os.getpid())  # differs per worker: only the sync makes them agree

    # Every worker keeps the whole training set (one shard of one): batches are drawn per (step, rank).
    (x_train, y_train), (x_test, y_test) = mnist_data.load_sharded(args.data_dir, rank=0, size=1)

    model = common.build_convnet(filters=(16,))  # Conv(16)-pool, Dense(64), Dense(10)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = SynchronousSGDOptimizer(tf.keras.optimizers.Adam(args.lr))
    # Create the optimizer state now: a new worker must broadcast the same variables as the others.
    opt.build(model.trainable_variables)

    @tf.function
    def train_step(images, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def sync(step):
        """Rank 0's step, model and optimizer state on every worker."""
        step = int(broadcast(tf.constant(step, tf.int64)))
        broadcast_variables(model.variables + list(opt.variables))
        return step

    step, need_sync, detached = 0, True, False
    while step < args.max_step:
        if need_sync:
            old = step
            step = sync(step)
            need_sync = False
            print(f"rank {current_rank()}/{current_cluster_size()}: synchronised at step {step}"
                  f"{'' if old == step else f' (was {old})'}", flush=True)
        rng = np.random.default_rng(step * 1000 + current_rank())
        idx = rng.integers(0, len(x_train), args.batch_size)
        loss = train_step(x_train[idx], y_train[idx])
        step += 1
        if current_rank() == 0 and step % 50 == 0:
            print(f"step {step}: {current_cluster_size()} workers, loss {float(loss):.4f}", flush=True)
        if step in schedule:
            changed, detached = resize(schedule[step])
            if detached:
                print(f"detached after step {step}", flush=True)
                break
            need_sync = changed

    if not detached:
        run_barrier()
        if current_rank() == 0:
            logits = model(x_test, training=False)
            accuracy = float(np.mean(np.argmax(logits, axis=1) == y_test))
            print(f"finished at step {step} with {current_cluster_size()} workers; "
                  f"test accuracy: {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()

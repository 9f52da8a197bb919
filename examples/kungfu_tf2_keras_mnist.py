"""KungFu-style MNIST training with Keras ``model.fit``, on sdp.

    sdprun -np 2 python examples/kungfu_tf2_keras_mnist.py --data-dir ../shared/data/mnist
    sdprun -np 2 python examples/kungfu_tf2_keras_mnist.py --optimizer sma   # or pair-avg

The KungFu Keras recipe (kungfu.tensorflow.* is sdp_kungfu_bridge.tensorflow.*): wrap the Keras
optimizer in a KungFu optimizer, compile, and pass ``BroadcastGlobalVariablesCallback`` to
``fit`` (it broadcasts rank 0's model and optimizer state after the first batch).
"""
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.append(str(_HERE.parent))

import common  # noqa: E402  (helpers shared by the examples; no TensorFlow yet: --help answers at once)


def parse_args(argv=None):
    p = common.argument_parser(__doc__)
    common.add_kungfu_optimizer_arg(p)
    # --data-dir, --epochs, --batch-size, --lr, --seed
    common.add_common_args(p, epochs=1, batch_size=64, lr=0.001, seed=1, per="worker")
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and flag errors before TensorFlow loads (5-20 s)

import tensorflow as tf  # noqa: E402

import mnist_data  # noqa: E402
from sdp_kungfu_bridge.python import (current_cluster_size, current_local_size,  # noqa: E402
                                      current_rank, run_barrier)
from sdp_kungfu_bridge.tensorflow.initializer import BroadcastGlobalVariablesCallback  # noqa: E402
from sdp_kungfu_bridge.tensorflow.optimizers import (PairAveragingOptimizer,  # noqa: E402
                                                     SynchronousAveragingOptimizer,
                                                     SynchronousSGDOptimizer)

OPTIMIZERS = {"sync-sgd": SynchronousSGDOptimizer, "sma": SynchronousAveragingOptimizer,
              "pair-avg": PairAveragingOptimizer}


def main():
    args = parse_args()
    rank, size = current_rank(), current_cluster_size()
    common.configure_threads(current_local_size(), min_inter_op=2)
    tf.keras.utils.set_random_seed(args.seed + rank)

    (x, y), (x_test, y_test) = mnist_data.load_sharded(args.data_dir, rank, size)  # equal shards
    per_worker = len(x)

    model = common.build_convnet(filters=(16, 32))  # Conv(16)-pool-Conv(32)-pool, Dense(64), Dense(10)
    lr = args.lr * size if args.optimizer == "sync-sgd" else args.lr
    # KungFu step 1: wrap the Keras optimizer.
    opt = OPTIMIZERS[args.optimizer](tf.keras.optimizers.Adam(lr), with_keras=True)
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    # KungFu step 2: the broadcast callback.  Every worker runs the same number of steps.
    steps = per_worker // args.batch_size
    model.fit(x[:steps * args.batch_size], y[:steps * args.batch_size], batch_size=args.batch_size,
              epochs=args.epochs, shuffle=True, verbose=1 if rank == 0 else 0,  # sdprun: a line every 10 s
              callbacks=[BroadcastGlobalVariablesCallback(with_keras=True)])
    run_barrier()  # with pair averaging, peers may still pull from this worker's store
    if rank == 0:
        print(f"evaluating on {len(x_test)} test images", flush=True)
        _, accuracy = model.evaluate(x_test, y_test, batch_size=1000, verbose=0)
        print(f"test accuracy: {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()

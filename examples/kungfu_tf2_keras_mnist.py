"""KungFu-style MNIST training with Keras ``model.fit``, on sdp.

    sdprun -np 2 python examples/kungfu_tf2_keras_mnist.py --data-dir ../shared/data/mnist
    sdprun -np 2 python examples/kungfu_tf2_keras_mnist.py --optimizer sma   # or pair-avg

The KungFu Keras recipe (kungfu.tensorflow.* is sdp_kungfu_bridge.tensorflow.*): wrap the Keras
optimizer in a KungFu optimizer, compile, and pass ``BroadcastGlobalVariablesCallback`` to
``fit`` (it broadcasts rank 0's model and optimizer state after the first batch).
"""
import argparse
import os
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.append(str(_HERE.parent))

import mnist_data  # noqa: E402
from sdp_kungfu_bridge.python import (current_cluster_size, current_local_size,  # noqa: E402
                                      current_rank, run_barrier)
from sdp_kungfu_bridge.tensorflow.initializer import BroadcastGlobalVariablesCallback  # noqa: E402
from sdp_kungfu_bridge.tensorflow.optimizers import (PairAveragingOptimizer,  # noqa: E402
                                                     SynchronousAveragingOptimizer,
                                                     SynchronousSGDOptimizer)

OPTIMIZERS = {"sync-sgd": SynchronousSGDOptimizer, "sma": SynchronousAveragingOptimizer,
              "pair-avg": PairAveragingOptimizer}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sync-sgd")
    p.add_argument("--data-dir", default=None,
                   help="directory with the MNIST IDX .gz files "
                        "(default: $SDP_MNIST_DIR or ../shared/data/mnist, else download)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64, help="batch size per worker")
    p.add_argument("--lr", type=float, default=0.001, help="Adam learning rate of one worker")
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


def main():
    args = parse_args()
    rank, size = current_rank(), current_cluster_size()
    threads = max(1, (os.cpu_count() or 1) // current_local_size())
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(max(2, threads))
    tf.keras.utils.set_random_seed(args.seed + rank)

    (x_train, y_train), (x_test, y_test) = mnist_data.load_mnist(args.data_dir or mnist_data.find_mnist_dir())
    per_worker = len(x_train) // size
    x = (x_train[rank::size][:per_worker].astype(np.float32) / 255.0)[..., np.newaxis]
    y = y_train[rank::size][:per_worker].astype(np.int64)

    model = tf.keras.Sequential([
        tf.keras.Input(shape=(28, 28, 1)),
        tf.keras.layers.Conv2D(16, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Conv2D(32, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10),
    ])
    lr = args.lr * size if args.optimizer == "sync-sgd" else args.lr
    # KungFu step 1: wrap the Keras optimizer.
    opt = OPTIMIZERS[args.optimizer](tf.keras.optimizers.Adam(lr), with_keras=True)
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    # KungFu step 2: the broadcast callback.  Every worker runs the same number of steps.
    steps = per_worker // args.batch_size
    model.fit(x[:steps * args.batch_size], y[:steps * args.batch_size], batch_size=args.batch_size,
              epochs=args.epochs, shuffle=True, verbose=2 if rank == 0 else 0,
              callbacks=[BroadcastGlobalVariablesCallback(with_keras=True)])
    run_barrier()  # with pair averaging, peers may still pull from this worker's store
    if rank == 0:
        _, accuracy = model.evaluate((x_test.astype(np.float32) / 255.0)[..., np.newaxis], y_test,
                                     batch_size=1000, verbose=0)
        print(f"test accuracy: {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()

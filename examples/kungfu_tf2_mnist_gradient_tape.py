"""KungFu-style MNIST training with a TensorFlow 2 GradientTape loop, on sdp.

    sdprun -np 2 python examples/kungfu_tf2_mnist_gradient_tape.py --data-dir ../shared/data/mnist
    sdprun -np 2 python examples/kungfu_tf2_mnist_gradient_tape.py --optimizer sma
    sdprun -np 2 python examples/kungfu_tf2_mnist_gradient_tape.py --optimizer pair-avg

The KungFu recipe (kungfu.tensorflow.* is sdp_kungfu_bridge.tensorflow.*):
  1. wrap the optimizer in a KungFu distributed optimizer:
     sync-sgd  SynchronousSGDOptimizer        (S-SGD: gradients averaged every step)
     sma       SynchronousAveragingOptimizer  (SMA: models averaged every step)
     pair-avg  PairAveragingOptimizer         (AD-PSGD: average with one random peer's model,
                                               pulled asynchronously)
  2. after the first step, broadcast the model and optimizer variables from rank 0;
  3. each worker reads its own shard of the data; rank 0 evaluates at the end.
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
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps (None: every step of --epochs)")
    p.add_argument("--v1-optimizer", action="store_true",
                   help="wrap tf.compat.v1.train.AdamOptimizer (as KungFu's example) instead of Keras Adam")
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and flag errors before TensorFlow loads (5-20 s)

import time  # noqa: E402

import tensorflow as tf  # noqa: E402

import mnist_data  # noqa: E402
from sdp_kungfu_bridge.python import (current_cluster_size, current_local_size,  # noqa: E402
                                      current_rank, run_barrier)
from sdp_kungfu_bridge.tensorflow.initializer import broadcast_variables  # noqa: E402
from sdp_kungfu_bridge.tensorflow.optimizers import (PairAveragingOptimizer,  # noqa: E402
                                                     SynchronousAveragingOptimizer,
                                                     SynchronousSGDOptimizer)

OPTIMIZERS = {"sync-sgd": SynchronousSGDOptimizer, "sma": SynchronousAveragingOptimizer,
              "pair-avg": PairAveragingOptimizer}


def main():
    args = parse_args()
    rank, size = current_rank(), current_cluster_size()
    common.configure_threads(current_local_size(), min_inter_op=2)
    tf.keras.utils.set_random_seed(args.seed + rank)  # models differ until the broadcast

    (x, y), (x_test, y_test) = mnist_data.load_sharded(args.data_dir, rank, size)  # equal shards
    per_worker = len(x)
    dataset = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(10000, seed=args.seed + rank)
               .batch(args.batch_size, drop_remainder=True).repeat(args.epochs))
    if args.steps:
        dataset = dataset.take(args.steps)

    model = common.build_convnet(filters=(16, 32))  # Conv(16)-pool-Conv(32)-pool, Dense(64), Dense(10)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # S-SGD sees size times more data per step: scale its learning rate; model averaging does not.
    lr = args.lr * size if args.optimizer == "sync-sgd" else args.lr
    opt = tf.compat.v1.train.AdamOptimizer(lr) if args.v1_optimizer else tf.keras.optimizers.Adam(lr)
    # KungFu step 1: wrap the optimizer.
    opt = OPTIMIZERS[args.optimizer](opt)

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        # KungFu step 2: after the first step (the optimizer state exists), start from rank 0's state.
        if first_batch:
            broadcast_variables(model.variables)
            broadcast_variables(opt.variables())
        return loss

    if rank == 0:
        print(f"training with {args.optimizer} on {size} worker(s), {per_worker} images each", flush=True)
    start = time.perf_counter()
    total = (per_worker // args.batch_size) * args.epochs
    progress = common.Progress(min(total, args.steps or total), rank, args.batch_size * size)
    for batch, (images, labels) in enumerate(dataset):
        loss = training_step(images, labels, batch == 0)
        progress.update(batch + 1, loss)
    progress.end()
    elapsed = time.perf_counter() - start
    run_barrier()  # with pair averaging, peers may still pull from this worker's store
    if rank == 0:
        print(f"evaluating on {len(x_test)} test images", flush=True)
        accuracy = common.evaluate(model, x_test, y_test)
        print(f"trained {batch + 1} steps in {elapsed:.1f} s", flush=True)
        print(f"test accuracy: {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()

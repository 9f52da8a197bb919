"""Data-parallel MNIST with Keras `model.fit`, sdp's DistributedOptimizer and Horovod-style callbacks.

    python examples/tf2_keras_mnist.py --data-dir ../shared/data/mnist
    sdprun -np 2 python examples/tf2_keras_mnist.py --data-dir ../shared/data/mnist

The Horovod Keras recipe (`import horovod.tensorflow.keras as hvd` works the same way with
`import sdp.tensorflow.keras as hvd`):
  1. hvd.init(), one GPU per process by local rank (if there are GPUs);
  2. each rank trains on its own shard of the data;
  3. scale the learning rate by hvd.size(), and warm it up from lr / size over the first epoch(s)
     (LearningRateWarmupCallback);
  4. wrap the optimizer in hvd.DistributedOptimizer, which averages gradients over ranks;
  5. BroadcastGlobalVariablesCallback(0) makes every rank start from rank 0's weights;
  6. MetricAverageCallback averages the logged metrics over ranks;
  7. only rank 0 writes checkpoints and prints.
"""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.append(str(_HERE.parent))

import common  # noqa: E402  (helpers shared by the examples; no TensorFlow yet: --help answers at once)


def parse_args(argv=None):
    p = common.argument_parser(__doc__)
    # --data-dir, --epochs, --batch-size, --lr, --seed
    common.add_common_args(p, epochs=2, batch_size=64, lr=0.001, seed=42)
    p.add_argument("--warmup-epochs", type=float, default=1.0,
                   help="epochs over which the learning rate grows from lr to lr * size")
    p.add_argument("--steps-per-epoch", type=int, default=None, help="cap on steps per epoch (None: no cap)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="directory where rank 0 saves a checkpoint after each epoch (None: no checkpoints)")
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and flag errors before TensorFlow loads (5-20 s)

import os  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import mnist_data  # noqa: E402
import sdp.tensorflow.keras as hvd  # noqa: E402


def main():
    args = parse_args()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    # Share the CPU cores between the processes on this machine; one GPU per process.
    common.configure_threads(hvd.local_size())
    common.pin_gpu(hvd.local_rank())

    # A different seed per rank: only the broadcast makes the initial weights agree.
    tf.keras.utils.set_random_seed(args.seed + rank)

    # Equal shards, so that every rank runs the same number of steps.
    (x_shard, y_shard), (x_test, y_test) = mnist_data.load_sharded(args.data_dir, rank, size)
    per_rank = len(x_shard)
    steps = per_rank // args.batch_size
    if args.steps_per_epoch:
        steps = min(steps, args.steps_per_epoch)
    dataset = common.without_autotune(  # see there: autotuning can stall the end of training
        tf.data.Dataset.from_tensor_slices((x_shard, y_shard))
        .shuffle(10000, seed=args.seed + rank).repeat()
        .batch(args.batch_size, drop_remainder=True))

    # Conv(16)-pool-Conv(32)-pool, Dropout(0.25), Dense(64), Dense(10)
    model = common.build_convnet(filters=(16, 32), dropout=0.25)
    scaled_lr = args.lr * size
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(scaled_lr))
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=args.warmup_epochs,
                                                 verbose=1),
    ]
    if rank == 0:
        if args.checkpoint_dir:
            callbacks.append(tf.keras.callbacks.ModelCheckpoint(
                os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.keras")))
        print(f"training on {size} rank(s): {per_rank} images and {steps} steps of {args.batch_size} per rank "
              f"per epoch" + (f"; checkpoints in {args.checkpoint_dir}" if args.checkpoint_dir else ""), flush=True)

    start = time.perf_counter()
    model.fit(dataset, steps_per_epoch=steps, epochs=args.epochs, callbacks=callbacks, shuffle=False,
              verbose=1 if rank == 0 else 0)  # a progress bar on rank 0 (sdprun: a line every 10 s)
    elapsed = time.perf_counter() - start

    # Every rank scores its half of the test set; the counts are summed over ranks.
    if rank == 0:
        print(f"evaluating on {len(x_test)} test images ({size} rank(s))", flush=True)
    xt, yt = x_test[rank::size], y_test[rank::size]
    correct = int(np.sum(np.argmax(model.predict(xt, batch_size=1000, verbose=0), axis=1) == yt))
    totals = hvd.allreduce(np.array([correct, len(yt)], np.int64), name="test_accuracy", op=hvd.Sum)
    if rank == 0:
        images = args.epochs * steps * args.batch_size * size
        print(f"trained {args.epochs} epoch(s) in {elapsed:.1f} s ({images / elapsed:.0f} images/sec)", flush=True)
        print(f"test accuracy: {int(totals[0]) / int(totals[1]):.4f}", flush=True)


if __name__ == "__main__":
    main()

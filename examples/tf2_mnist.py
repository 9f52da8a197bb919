"""Data-parallel MNIST training with sdp and a TensorFlow 2 GradientTape loop.

The same script runs on one process or on many; sdp does the gradient averaging:

    python examples/tf2_mnist.py --data-dir ../shared/data/mnist
    sdprun -np 2 python examples/tf2_mnist.py --data-dir ../shared/data/mnist

The recipe is the usual Horovod / SageMaker data-parallel one:
  1. sdp.init(), and pin one GPU per process by local rank (if there are GPUs);
  2. give each rank its own shard of the training data;
  3. scale the learning rate by sdp.size();
  4. wrap the tape in sdp.DistributedGradientTape, which averages gradients over ranks;
  5. after the first step, broadcast model and optimizer state from rank 0;
  6. checkpoint (and evaluate) on rank 0 only.
"""

import sys
from pathlib import Path

# mnist_data.py and common.py (helpers shared by the examples) live next to this
# script. Running from a source checkout without `pip install` also works: the
# repository root goes last on the path, so an installed sdp wins if there is one.
_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.append(str(_HERE.parent))

import common  # noqa: E402  (no TensorFlow yet: --help answers at once)


def parse_args(argv=None):
    p = common.argument_parser(__doc__)
    # --data-dir, --epochs, --batch-size, --lr, --seed
    common.add_common_args(p, epochs=1, batch_size=64, lr=0.001, seed=42)
    p.add_argument("--steps", type=int, default=None,
                   help="stop after this many training steps in total (None: no cap)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="directory where rank 0 saves the final checkpoint (None: no checkpoint)")
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and flag errors before TensorFlow loads (5-20 s)

import hashlib  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import mnist_data  # noqa: E402
import sdp.tensorflow as sdp  # noqa: E402


def build_model():
    return tf.keras.Sequential([
        tf.keras.Input(shape=(28, 28, 1)),
        tf.keras.layers.Conv2D(32, 3, activation="relu"),
        tf.keras.layers.Conv2D(64, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10),
    ])


def weights_checksum(model):
    flat = np.concatenate([w.numpy().ravel() for w in model.trainable_variables])
    return hashlib.sha256(flat.tobytes()).hexdigest()[:16]


def main():
    args = parse_args()

    sdp.init()
    rank, size = sdp.rank(), sdp.size()

    # Share the CPU cores between the processes on this machine instead of
    # letting each of them start one thread per core.
    common.configure_threads(sdp.local_size())
    # One GPU per process, chosen by local rank.
    common.pin_gpu(sdp.local_rank())

    # A different seed on each rank: the ranks start from different weights, and
    # only the broadcast below makes them agree.
    tf.keras.utils.set_random_seed(args.seed + rank)

    # Each rank trains on its own shard, cut to a common length so that every
    # rank runs the same number of steps (a rank with an extra step would wait
    # forever for the others in allreduce).
    (x_shard, y_shard), (x_test, y_test) = mnist_data.load_sharded(args.data_dir, rank, size)
    per_rank = len(x_shard)
    steps_per_epoch = per_rank // args.batch_size
    if steps_per_epoch == 0:
        raise SystemExit(f"--batch-size {args.batch_size} is larger than the "
                         f"{per_rank} training images per rank")

    # Autotuning off: it can hold up the end of an epoch by ~17 s (see common.without_autotune).
    dataset = common.without_autotune(
        tf.data.Dataset.from_tensor_slices((x_shard, y_shard))
        .shuffle(10000, seed=args.seed + rank, reshuffle_each_iteration=True)
        .batch(args.batch_size, drop_remainder=True))

    model = build_model()
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # With size ranks, each step sees size times more data: scale the LR with it.
    opt = tf.keras.optimizers.Adam(args.lr * size)

    @tf.function
    def training_step(images, labels):
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            loss = loss_fn(labels, logits)
        # Averages the gradients over all ranks before they are applied.
        tape = sdp.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    if rank == 0:
        print(f"training on {size} rank(s): {per_rank} images and "
              f"{steps_per_epoch} steps of {args.batch_size} per rank per epoch", flush=True)

    step = 0
    done = False
    for epoch in range(1, args.epochs + 1):
        start = time.perf_counter()
        losses = []
        progress = common.Progress(steps_per_epoch, rank, args.batch_size * size)  # a bar on rank 0
        for images, labels in dataset:
            losses.append(training_step(images, labels))
            step += 1
            if step == 1:
                # The optimizer creates its slots on the first step; now that
                # they exist, copy model and optimizer state from rank 0.
                sdp.broadcast_variables(model.variables, root_rank=0)
                sdp.broadcast_variables(opt.variables, root_rank=0)
            progress.update(len(losses), losses[-1])
            if args.steps is not None and step >= args.steps:
                done = True
                break
        progress.end()
        elapsed = time.perf_counter() - start
        # Every rank takes part in the allreduce; only rank 0 reports.
        mean_loss = sdp.allreduce(tf.reduce_mean(tf.stack(losses)), op=sdp.ReduceOp.AVERAGE)
        if rank == 0:
            images_per_sec = len(losses) * args.batch_size * size / elapsed
            print(f"epoch {epoch}: loss {float(mean_loss):.4f}, "
                  f"{images_per_sec:.0f} images/sec, {elapsed:.1f} s", flush=True)
        if done:
            break

    if rank == 0:
        if args.checkpoint_dir:
            checkpoint = tf.train.Checkpoint(model=model, optimizer=opt)
            path = checkpoint.save(os.path.join(args.checkpoint_dir, "ckpt"))
            print(f"checkpoint saved to {path}", flush=True)

        print(f"evaluating on {len(x_test)} test images", flush=True)
        accuracy = common.evaluate(model, x_test, y_test)
        print(f"test accuracy: {accuracy:.4f}", flush=True)

    print(f"weights checksum: {weights_checksum(model)}", flush=True)


if __name__ == "__main__":
    main()

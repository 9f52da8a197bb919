"""TF1-style data-parallel MNIST: a tf.compat.v1 graph, MonitoredTrainingSession,
BroadcastGlobalVariablesHook and DistributedOptimizer over a tf.compat.v1.train optimizer.

    python examples/tf1_mnist_session.py --data-dir ../shared/data/mnist
    sdprun -np 2 python examples/tf1_mnist_session.py --data-dir ../shared/data/mnist

The model is a single softmax layer (multinomial logistic regression), as in the classic TF1
tutorial.  The Horovod TF1 recipe, unchanged apart from the import:
  1. hvd.init();
  2. each rank reads its own shard;
  3. scale the learning rate by hvd.size() and wrap the optimizer in hvd.DistributedOptimizer;
  4. hvd.BroadcastGlobalVariablesHook(0) copies rank 0's initial variables to every rank;
  5. only rank 0 writes checkpoints (checkpoint_dir=None elsewhere).
(tf.estimator was removed in TensorFlow 2.16; MonitoredTrainingSession is what remains of that style.)
"""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.append(str(_HERE.parent))

import common  # noqa: E402  (helpers shared by the examples; no TensorFlow yet: --help answers at once)


def parse_args(argv=None):
    p = common.argument_parser(__doc__)
    # --data-dir, --batch-size, --lr, --seed
    common.add_common_args(p, epochs=None, batch_size=100, lr=0.002, seed=42)
    p.add_argument("--steps", type=int, default=600, help="training steps (every rank runs all of them)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="directory where rank 0's MonitoredTrainingSession writes checkpoints (None: none)")
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and flag errors before TensorFlow loads (5-20 s)

import time  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import mnist_data  # noqa: E402
import sdp.tensorflow as hvd  # noqa: E402


def main():
    args = parse_args()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    (x_train, y_train), (x_test, y_test) = mnist_data.load_mnist(args.data_dir or mnist_data.find_mnist_dir())
    x_shard = (x_train[rank::size].reshape(-1, 784) / 255.0).astype(np.float32)
    y_shard = y_train[rank::size].astype(np.int64)
    rng = np.random.default_rng(args.seed + rank)

    threads = common.threads_per_process(hvd.local_size())  # CPU cores shared by local ranks
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=threads, inter_op_parallelism_threads=threads)

    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(args.seed + rank)  # ranks differ until the hook broadcasts
        images = tf.compat.v1.placeholder(tf.float32, [None, 784], name="images")
        labels = tf.compat.v1.placeholder(tf.int64, [None], name="labels")
        w = tf.compat.v1.get_variable("w", [784, 10], initializer=tf.compat.v1.glorot_uniform_initializer())
        b = tf.compat.v1.get_variable("b", [10], initializer=tf.compat.v1.zeros_initializer())
        logits = tf.matmul(images, w) + b
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
        accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), labels), tf.float32))

        global_step = tf.compat.v1.train.get_or_create_global_step()
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.AdamOptimizer(args.lr * size))
        train_op = opt.minimize(loss, global_step=global_step)

        hooks = [hvd.BroadcastGlobalVariablesHook(0)]
        checkpoint_dir = args.checkpoint_dir if rank == 0 else None
        if rank == 0:
            print(f"training on {size} rank(s), {args.steps} steps of {args.batch_size} per rank"
                  + (f"; checkpoints in {checkpoint_dir}" if checkpoint_dir else ""), flush=True)

        with tf.compat.v1.train.MonitoredTrainingSession(checkpoint_dir=checkpoint_dir, hooks=hooks,
                                                         config=config, save_summaries_steps=None,
                                                         save_summaries_secs=None) as sess:
            progress = common.Progress(args.steps, rank, args.batch_size * size)  # a bar on rank 0
            start = time.perf_counter()
            for step in range(1, args.steps + 1):
                idx = rng.integers(0, len(x_shard), args.batch_size)
                _, loss_value = sess.run([train_op, loss], feed_dict={images: x_shard[idx], labels: y_shard[idx]})
                progress.update(step, loss_value)
            elapsed = time.perf_counter() - start  # the training steps (the bar's time, too)
            if rank == 0:
                print(f"evaluating on {len(x_test)} test images", flush=True)
            test_acc = sess.run(accuracy, feed_dict={images: (x_test.reshape(-1, 784) / 255.0).astype(np.float32),
                                                     labels: y_test.astype(np.int64)})

    if rank == 0:
        print(f"trained {args.steps} steps in {elapsed:.1f} s", flush=True)
        print(f"test accuracy: {test_acc:.4f}", flush=True)


if __name__ == "__main__":
    main()

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

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tensorflow as tf

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.append(str(_HERE.parent))

import common  # noqa: E402  (helpers shared by the examples)
import mnist_data  # noqa: E402
import sdp.tensorflow as hvd  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # --data-dir, --batch-size, --lr, --seed
    common.add_common_args(p, epochs=None, batch_size=100, lr=0.002, seed=42)
    p.add_argument("--steps", type=int, default=600, help="training steps (every rank runs all of them)")
    p.add_argument("--checkpoint-dir", default=None, help="rank 0's checkpoint directory (default: a temp dir)")
    return p.parse_args()


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
        checkpoint_dir = None
        if rank == 0:
            checkpoint_dir = args.checkpoint_dir or tempfile.mkdtemp(prefix="sdp_tf1_mnist_")
            print(f"training on {size} rank(s), {args.steps} steps of {args.batch_size} per rank; "
                  f"checkpoints in {checkpoint_dir}", flush=True)

        start = time.perf_counter()
        with tf.compat.v1.train.MonitoredTrainingSession(checkpoint_dir=checkpoint_dir, hooks=hooks,
                                                         config=config, save_summaries_steps=None,
                                                         save_summaries_secs=None) as sess:
            for step in range(1, args.steps + 1):
                idx = rng.integers(0, len(x_shard), args.batch_size)
                _, loss_value = sess.run([train_op, loss], feed_dict={images: x_shard[idx], labels: y_shard[idx]})
                if rank == 0 and step % 100 == 0:
                    print(f"step {step}: loss {loss_value:.4f}", flush=True)
            test_acc = sess.run(accuracy, feed_dict={images: (x_test.reshape(-1, 784) / 255.0).astype(np.float32),
                                                     labels: y_test.astype(np.int64)})
        elapsed = time.perf_counter() - start

    if rank == 0:
        print(f"trained {args.steps} steps in {elapsed:.1f} s", flush=True)
        print(f"test accuracy: {test_acc:.4f}", flush=True)


if __name__ == "__main__":
    main()

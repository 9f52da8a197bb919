"""Elastic data-parallel MNIST (Horovod Elastic's pattern) with sdp: survives dying workers and
grows when slots are added.

    sdprun -np 3 --min-np 2 --max-np 4 --host-discovery-script ./discover.sh \\
        python examples/tf2_mnist_elastic.py --data-dir ../shared/data/mnist

(``discover.sh`` prints ``localhost:3``; print more slots later and the job grows at its next
commit.)  The recipe, as in Horovod's ``tensorflow2_mnist_elastic.py``:

  1. init, build the model and the optimizer's variables (so every rank can sync them);
  2. wrap the training loop in ``@sdp.elastic.run`` and keep everything it must resume from in
     a ``TensorFlowKerasState`` (model, optimizer, ``epoch``, ``batch``, ``done``);
  3. ``state.commit()`` every ``--commit-every`` batches.  When a worker dies the others raise
     ``HorovodInternalError`` in a collective, roll back to the last commit, re-form with new
     ranks and go on; new workers get rank 0's state by ``sync``.

Each step trains one *global* batch (``--batch-size`` images, the same ones whatever the number
of workers: rank r takes rows r, r+n, ...), so the learning rate needs no rescaling when the job
changes size.  ``state.done`` lists the global batches trained since the start; at the end rank 0
checks that every batch of the run is in it exactly once ("batches: N trained once, 0 twice,
0 lost") -- a rollback that kept uncommitted batches, or a re-formation that skipped some, would
show here.  Every rank prints its weights checksum after each sync and at the end.
"""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.append(str(_HERE.parent))

import common  # noqa: E402  (helpers shared by the examples; no TensorFlow yet: --help answers at once)


def parse_args(argv=None):
    p = common.argument_parser(__doc__)
    common.add_common_args(p, epochs=1, batch_size=128, lr=0.001, seed=42, per="step")
    p.add_argument("--commit-every", type=int, default=10, help="commit the state every N batches")
    p.add_argument("--steps", type=int, default=None, help="train only this many global batches in all (None: every batch of --epochs)")
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="sleep this long after each step (seconds; lets tests act mid-run)")
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and flag errors before TensorFlow loads (5-20 s)

import hashlib  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import mnist_data  # noqa: E402
import sdp.tensorflow as sdp  # noqa: E402
from sdp.tensorflow import elastic  # noqa: E402


def checksum(model):
    flat = np.concatenate([w.numpy().ravel() for w in model.variables])
    return hashlib.sha256(flat.tobytes()).hexdigest()[:16]


def main():
    args = parse_args()
    sdp.init()
    common.configure_threads(sdp.local_size())
    tf.keras.utils.set_random_seed(args.seed + sdp.rank())  # different on each rank: sync makes them agree

    (x_train, y_train), (x_test, y_test) = mnist_data.load_mnist(args.data_dir)
    x_train, x_test = mnist_data.preprocess(x_train), mnist_data.preprocess(x_test)
    steps_per_epoch = len(x_train) // args.batch_size
    total = steps_per_epoch * args.epochs if args.steps is None else min(args.steps, steps_per_epoch * args.epochs)
    orders = [np.random.default_rng(args.seed + e).permutation(len(x_train)) for e in range(args.epochs)]

    model = common.build_convnet(filters=(32, 64))
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = tf.keras.optimizers.Adam(args.lr)
    opt.build(model.trainable_variables)  # the optimizer's variables exist on every rank before sync

    @tf.function
    def training_step(images, labels):
        with tf.GradientTape() as tape:
            # the mean over this rank's rows; averaging over ranks gives the global batch's mean
            loss = loss_fn(labels, model(images, training=True))
        tape = sdp.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def global_batch(g):
        epoch, b = divmod(g, steps_per_epoch)
        idx = orders[epoch][b * args.batch_size:(b + 1) * args.batch_size]
        mine = idx[sdp.rank()::sdp.size()]
        return x_train[mine], y_train[mine]

    @elastic.run
    def train(state):
        print(f"sync: rank {sdp.rank()} of {sdp.size()} at batch {state.batch}, "
              f"weights {checksum(model)}", flush=True)
        while state.batch < total:
            images, labels = global_batch(state.batch)
            loss = training_step(images, labels)
            state.done.append(state.batch)
            state.batch += 1
            if sdp.rank() == 0 and state.batch % 50 == 0:
                print(f"step {state.batch}/{total} on {sdp.size()} ranks: loss {float(loss):.4f}", flush=True)
            if args.step_delay:
                time.sleep(args.step_delay)
            if state.batch % args.commit_every == 0:
                state.commit()

    state = elastic.TensorFlowKerasState(model, opt, batch=0, done=[])
    state.register_reset_callbacks([lambda: print(f"reset: now rank {sdp.rank()} of {sdp.size()}", flush=True)])
    t0 = time.time()
    train(state)
    print(f"final: rank {sdp.rank()} of {sdp.size()}, weights {checksum(model)}", flush=True)
    if sdp.rank() == 0:
        done = np.bincount(np.asarray(state.done, np.int64), minlength=total)
        print(f"batches: {int(np.sum(done == 1))} trained once, {int(np.sum(done > 1))} twice, "
              f"{int(np.sum(done == 0))} lost (of {total})", flush=True)
        print(f"evaluating on {len(x_test)} test images", flush=True)
        acc = common.evaluate(model, x_test, y_test)
        print(f"test accuracy: {acc:.4f} ({time.time() - t0:.1f} s)", flush=True)
    sdp.shutdown()


if __name__ == "__main__":
    main()

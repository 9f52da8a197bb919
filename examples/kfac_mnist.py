"""K-FAC on MNIST / Fashion-MNIST, data-parallel with sdp (the convnet of TensorFlow kfac's distributed guide).

    python examples/kfac_mnist.py
    sdprun -np 2 python examples/kfac_mnist.py --strategy split
    sdprun -np 3 python examples/kfac_mnist.py --strategy chief
    sdprun -np 2 python examples/kfac_mnist.py --optimizer adam --lr 0.002
    sdprun -np 2 python examples/kfac_mnist.py --data-dir ../shared/data/fashion-mnist

The model is the guide's: Conv2D(5x5, 16, ReLU) -> MaxPool(3, stride 2) -> Conv2D(5x5, 16, ReLU) ->
MaxPool(3, stride 2) -> Dense(10), all with "same" padding.  ``--batch-size`` is the *global* batch,
split evenly over the ranks, so a run with any number of ranks takes the same steps; every optimizer
(``kfac``, ``sgd-momentum``, ``adam``) sees the same model, batch, cosine schedule and step budget.
K-FAC's defaults (momentum 0.5, norm constraint 3e-3, damping 1e-3, inverses every 10 steps,
factors every 5) are the best of a sweep on Fashion-MNIST at batch 1080 (``benchmarks/kfac.py``);
SGD keeps momentum 0.9.  With ``kfac``
the gradients (and factors) are averaged by :class:`sdp.tensorflow.kfac.KfacOptimizer`; the
first-order optimizers use ``sdp.DistributedGradientTape``.  Rank 0 logs the test accuracy every
``--eval-every`` steps (and every step while within ``--eval-near`` below a ``--target-accuracy``)
and at the end; every rank prints its weights checksum.
"""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.append(str(_HERE.parent))

import common  # noqa: E402  (no TensorFlow yet: --help answers at once)

DEFAULT_LR = {"kfac": 0.1, "sgd-momentum": 0.1, "adam": 0.002}
DEFAULT_MOMENTUM = {"kfac": 0.5, "sgd-momentum": 0.9}  # K-FAC's clipped steps overshoot with 0.9
STRATEGIES = ("chief", "split")  # sdp.tensorflow.kfac.STRATEGIES
ESTIMATION_MODES = ("empirical", "gradients")  # sdp.tensorflow.kfac.ESTIMATION_MODES


def parse_args(argv=None):
    p = common.argument_parser(__doc__)
    p.add_argument("--data-dir", default=None,
                   help="directory with the (Fashion-)MNIST IDX .gz files; None: $SDP_MNIST_DIR or "
                        "../shared/data/mnist, else Keras' mnist.npz (downloaded once)")
    p.add_argument("--optimizer", choices=("kfac", "sgd-momentum", "adam"), default="kfac",
                   help="the optimizer to train with")
    p.add_argument("--strategy", choices=STRATEGIES, default="split",
                   help="K-FAC distribution: rank 0 inverts everything (chief) or each layer's owner (split)")
    p.add_argument("--batch-size", type=int, default=1080, help="global batch size, split over the ranks")
    p.add_argument("--steps", type=int, default=300, help="training steps")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (None: %s)" % ", ".join(f"{k} {v}" for k, v in DEFAULT_LR.items()))
    p.add_argument("--momentum", type=float, default=None,
                   help="momentum of kfac and sgd-momentum (None: %s)"
                        % ", ".join(f"{k} {v}" for k, v in DEFAULT_MOMENTUM.items()))
    p.add_argument("--damping", type=float, default=1e-3, help="K-FAC Tikhonov damping")
    p.add_argument("--cov-ema-decay", type=float, default=0.95, help="K-FAC factors' moving-average decay")
    p.add_argument("--norm-constraint", type=float, default=3e-3, help="K-FAC KL clip (0: off)")
    p.add_argument("--inv-update-every", type=int, default=10, help="refresh K-FAC's inverses every N steps")
    p.add_argument("--cov-update-every", type=int, default=5, help="update K-FAC's factors every N steps")
    p.add_argument("--estimation-mode", choices=ESTIMATION_MODES, default="empirical",
                   help="K-FAC's G factors from the true labels (empirical) or from labels sampled "
                        "from the model (gradients)")
    p.add_argument("--eval-every", type=int, default=100, help="log test accuracy every N steps (0: only at the end)")
    p.add_argument("--target-accuracy", default=None,
                   help="comma-separated test accuracies: stop at the first evaluation that reaches the highest")
    p.add_argument("--eval-near", type=float, default=0.0,
                   help="evaluate every step while the last test accuracy is within this much below a "
                        "--target-accuracy not reached yet (so steps to each target are exact)")
    p.add_argument("--seed", type=int, default=42, help="random seed (each rank adds its rank)")
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and flag errors before TensorFlow loads (5-20 s)

import hashlib  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import mnist_data  # noqa: E402
import sdp.tensorflow as sdp  # noqa: E402
from sdp.tensorflow import kfac  # noqa: E402

assert kfac.STRATEGIES == STRATEGIES and kfac.ESTIMATION_MODES == ESTIMATION_MODES


def build_model():
    """The convnet of kfac's convnet_mnist example: two 5x5x16 convolutions, two 3x3/2 max pools, a
    linear layer to 10 logits; input (B, 28, 28, 1) float32."""
    layers = tf.keras.layers
    return tf.keras.Sequential([
        tf.keras.Input(shape=(28, 28, 1)),
        layers.Conv2D(16, 5, padding="same", activation="relu"),
        layers.MaxPooling2D(3, strides=2, padding="same"),
        layers.Conv2D(16, 5, padding="same", activation="relu"),
        layers.MaxPooling2D(3, strides=2, padding="same"),
        layers.Flatten(),
        layers.Dense(10),
    ])


def weights_checksum(model):
    flat = np.concatenate([w.numpy().ravel() for w in model.trainable_variables])
    return hashlib.sha256(flat.tobytes()).hexdigest()[:16]


def make_trainer(args, model, loss_fn, size):
    """A function ``(x, y) -> loss`` doing one synchronous step, and the K-FAC optimizer (or None)."""
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer]
    momentum = args.momentum if args.momentum is not None else DEFAULT_MOMENTUM.get(args.optimizer)
    # the same cosine decay over the step budget for every optimizer
    lr = tf.keras.optimizers.schedules.CosineDecay(lr, args.steps, alpha=0.01)
    if args.optimizer == "kfac":
        opt = kfac.KfacOptimizer(model, loss_fn, learning_rate=lr, damping=args.damping,
                                 cov_ema_decay=args.cov_ema_decay, momentum=momentum,
                                 norm_constraint=args.norm_constraint or None,
                                 inv_update_every=args.inv_update_every,
                                 cov_update_every=args.cov_update_every, strategy=args.strategy,
                                 estimation_mode=args.estimation_mode)
        return opt.step, opt
    if args.optimizer == "adam":
        opt = tf.keras.optimizers.Adam(lr)
    else:
        opt = tf.keras.optimizers.SGD(lr, momentum=momentum)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = sdp.DistributedGradientTape(tape) if size > 1 else tape
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return train_step, None


def main(argv=None):
    args = parse_args(argv)
    sdp.init()
    rank, size = sdp.rank(), sdp.size()
    common.configure_threads(sdp.local_size())
    common.pin_gpu(sdp.local_rank())
    if args.batch_size % size:
        raise SystemExit(f"--batch-size {args.batch_size} is not divisible by the {size} ranks")
    batch = args.batch_size // size

    tf.keras.utils.set_random_seed(args.seed + rank)  # differs per rank: the broadcast makes them agree
    (x_shard, y_shard), (x_test, y_test) = mnist_data.load_sharded(args.data_dir, rank, size)
    model = build_model()
    if size > 1:
        sdp.broadcast_variables(model.variables, root_rank=0)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    train_step, kfac_opt = make_trainer(args, model, loss_fn, size)

    if rank == 0:
        what = args.optimizer + (f" ({args.strategy})" if args.optimizer == "kfac" else "")
        print(f"training {what} on {size} rank(s): global batch {args.batch_size}, {args.steps} steps",
              flush=True)
    rng = np.random.default_rng(args.seed + rank)
    order, pos = rng.permutation(len(x_shard)), 0
    targets = sorted(float(t) for t in args.target_accuracy.split(",")) if args.target_accuracy else []
    start, accuracy, step = time.perf_counter(), None, 0
    progress = common.Progress(args.steps, rank, args.batch_size)  # a bar on rank 0
    while step < args.steps:
        if pos + batch > len(order):
            order, pos = rng.permutation(len(x_shard)), 0
        idx = order[pos:pos + batch]
        pos += batch
        loss = train_step(tf.constant(x_shard[idx]), tf.constant(y_shard[idx]))
        step += 1
        progress.update(step, loss)
        near = accuracy is not None and any(t - args.eval_near <= accuracy < t for t in targets)
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps or near:
            if rank == 0 and not near:
                print(f"step {step}: evaluating on {len(x_test)} test images", flush=True)
            accuracy = common.evaluate(model, x_test, y_test) if rank == 0 else 0.0
            if size > 1:  # every rank learns whether the target was reached
                accuracy = float(sdp.broadcast(tf.constant(accuracy), 0, name="kfac_mnist.accuracy"))
            if rank == 0:
                print(f"step {step}: loss {float(loss):.4f}, test accuracy {accuracy:.4f}, "
                      f"{time.perf_counter() - start:.1f} s", flush=True)
            if targets and accuracy >= targets[-1]:
                break
    progress.end()
    elapsed = time.perf_counter() - start
    if kfac_opt is not None:  # every rank: the inversion work differs between ranks
        t = kfac_opt.timings
        print("time per step (s): " + ", ".join(f"{k} {v / step:.4f}" for k, v in t.items()), flush=True)
    if rank == 0:
        print(f"steps: {step}, wall time: {elapsed:.1f} s", flush=True)
        print(f"test accuracy: {accuracy:.4f}", flush=True)
    print(f"weights checksum: {weights_checksum(model)}", flush=True)


if __name__ == "__main__":
    main()

"""Small helpers shared by the sdp examples: flags, CPU threads, GPU pinning, the input pipeline's
options, a model, a progress bar, evaluation.

Only the set-up that every example repeats lives here.  What makes training distributed
(``init``, ``DistributedGradientTape`` / ``DistributedOptimizer``, the KungFu optimizers, the
broadcast from rank 0) stays in each example, where it can be read.

The MNIST loading and sharding helpers are in ``mnist_data.py`` next to this file.

This module imports TensorFlow only inside the functions that need it, so that an example can
parse its arguments (and answer ``--help``) before TensorFlow loads, which takes 5-20 s.
"""

import argparse
import os
import sys
import time

import numpy as np


def argument_parser(doc):
    """An ``argparse`` parser whose description is the first paragraph of ``doc`` (the example's
    docstring) and whose help shows every flag's default."""
    first = doc.strip().split("\n\n")[0]
    return argparse.ArgumentParser(description=" ".join(first.split()),
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def add_common_args(parser, *, batch_size=64, lr=0.001, epochs=1, seed=42, per="rank"):
    """Add the flags the MNIST examples share to an ``argparse`` parser.

    ``--data-dir``, ``--batch-size`` and ``--lr`` always; ``--epochs`` and ``--seed`` unless their
    default is None.  ``per`` names one process in the help texts ("rank" or "worker").
    """
    parser.add_argument("--data-dir", default=None,
                        help="directory with the MNIST IDX .gz files; None: $SDP_MNIST_DIR or "
                             "../shared/data/mnist, else Keras' mnist.npz (downloaded once)")
    if epochs is not None:
        parser.add_argument("--epochs", type=int, default=epochs, help="passes over the training data")
    parser.add_argument("--batch-size", type=int, default=batch_size, help=f"batch size per {per}")
    parser.add_argument("--lr", type=float, default=lr, help=f"Adam learning rate for one {per}")
    if seed is not None:
        parser.add_argument("--seed", type=int, default=seed,
                            help=f"random seed (each {per} adds its rank)")
    return parser


KUNGFU_OPTIMIZERS = ("pair-avg", "sma", "sync-sgd")


def add_kungfu_optimizer_arg(parser):
    """``--optimizer`` of the KungFu examples: one of ``KUNGFU_OPTIMIZERS``."""
    parser.add_argument("--optimizer", choices=KUNGFU_OPTIMIZERS, default="sync-sgd",
                        help="KungFu optimizer: S-SGD (sync-sgd), SMA model averaging (sma) or "
                             "AD-PSGD pair averaging (pair-avg)")
    return parser


class Progress:
    """Rank 0's progress bar for a training loop: a Keras ``Progbar`` of ``target`` steps showing
    the mean loss so far and images/s (``images_per_step`` over the time since the previous
    update); does nothing on other ranks.  Call ``update(step, loss)`` after each step, and
    ``end()`` after a loop that may stop before ``target``.

    Keras redraws the bar in place (with a carriage return); ``sdprun`` shows such an in-place
    line at most every 10 s, and the last one."""

    def __init__(self, target, rank, images_per_step):
        self.bar = None
        if rank == 0:
            import keras
            self.bar = keras.utils.Progbar(target, stateful_metrics=["loss", "images/s"],
                                           interval=0.5 if sys.stdout.isatty() else 0.05)
        self.target, self.images_per_step = target, images_per_step
        self.step, self.loss_sum, self.count, self.last = 0, 0.0, 0, time.perf_counter()

    def update(self, step, loss):
        if self.bar is None:
            return
        now = time.perf_counter()
        rate = self.images_per_step / max(now - self.last, 1e-9)
        self.loss_sum, self.count, self.last = self.loss_sum + float(loss), self.count + 1, now
        self.step = step
        self.bar.update(step, [("loss", self.loss_sum / self.count), ("images/s", round(rate))])

    def end(self):
        """End the bar's line if the loop stopped before ``target`` (Keras ends it at ``target``)."""
        if self.bar is not None and 0 < self.step < self.target:
            print(flush=True)


def interrupted(rank, step):
    """Ctrl-C / SIGTERM reached this rank: say where, in one line, and exit with 130."""
    print(f"rank {rank}: interrupted at step {step}", file=sys.stderr, flush=True)
    raise SystemExit(130)


def threads_per_process(local_size):
    """The CPU cores of this machine divided among its ``local_size`` processes (at least 1)."""
    return max(1, (os.cpu_count() or 1) // local_size)


def configure_threads(local_size, min_inter_op=1):
    """Share the CPU cores between the processes on this machine instead of letting each of them
    start one thread per core.  Sets TensorFlow's intra-op threads to the cores per process and its
    inter-op threads to that, or to ``min_inter_op`` if more; returns the cores per process.
    Call it before TensorFlow runs any op."""
    import tensorflow as tf
    threads = threads_per_process(local_size)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(max(min_inter_op, threads))
    return threads


def pin_gpu(local_rank):
    """One GPU per process, chosen by local rank, with memory growth on; nothing without GPUs.
    Call it before TensorFlow initialises its devices."""
    import tensorflow as tf
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.set_visible_devices(gpus[local_rank % len(gpus)], "GPU")


def without_autotune(dataset, prefetch=2):
    """``dataset`` with a fixed prefetch of ``prefetch`` batches and tf.data's autotuning off.

    With autotuning on, deleting an iterator (at the end of a ``for`` loop over a dataset) waits
    for tf.data's autotuning thread; in about one run in three here (TF 2.21) that held the end
    of an epoch up by ~17 s, with the CPUs idle.  An in-memory MNIST pipeline needs no tuning."""
    import tensorflow as tf
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.prefetch(prefetch).with_options(options)


def build_convnet(filters=(16, 32), dropout=None):
    """A small MNIST convnet for (28, 28, 1) images, returning logits for 10 classes: one
    Conv2D(3x3, ReLU) + MaxPooling2D block per entry of ``filters``, Flatten, Dropout(``dropout``)
    if given, Dense(64, ReLU), Dense(10)."""
    import tensorflow as tf
    layers = [tf.keras.Input(shape=(28, 28, 1))]
    for n in filters:
        layers += [tf.keras.layers.Conv2D(n, 3, activation="relu"), tf.keras.layers.MaxPooling2D()]
    layers.append(tf.keras.layers.Flatten())
    if dropout:
        layers.append(tf.keras.layers.Dropout(dropout))
    layers += [tf.keras.layers.Dense(64, activation="relu"), tf.keras.layers.Dense(10)]
    return tf.keras.Sequential(layers)


def evaluate(model, images, labels, batch_size=1000):
    """The fraction of ``images`` that ``model`` (which returns logits) labels correctly."""
    correct = 0
    for i in range(0, len(images), batch_size):
        logits = model(images[i:i + batch_size], training=False)
        correct += int(np.sum(np.argmax(logits, axis=1) == labels[i:i + batch_size]))
    return correct / len(images)

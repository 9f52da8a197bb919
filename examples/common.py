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
    """Rank 0's progress line for a training loop of ``target`` steps: the step, the mean loss so
    far, images/s and the time left; does nothing on other ranks.  Call ``update(step, loss)``
    after each step, and ``end()`` after a loop that may stop before ``target``.

    The first step's time stays out of the rate and the time left: it includes TensorFlow tracing
    the step (and, on a first run, sdp building its TensorFlow op), which made a first line read
    ``1/468 ... 1:38:24``.  A line of its own says how long it took; the progress line starts at
    the next step.  The rate is the images of the steps after the first over their time.

    The line is redrawn in place (a carriage return, at most every 0.5 s on a terminal, 0.05 s
    otherwise); ``sdprun`` shows such an in-place line at most every 10 s, the first at once, and
    the last.  The last one ends with a newline."""

    WIDTH = 20

    def __init__(self, target, rank, images_per_step, clock=time.perf_counter, out=None):
        self.active = rank == 0
        self.target, self.images_per_step, self.clock = target, images_per_step, clock
        self.out = out if out is not None else sys.stdout
        self.interval = 0.5 if self.out.isatty() else 0.05
        self.start = clock()
        self.first_done = None  # the time step 1 ended
        self.step, self.loss_sum, self.count, self.shown_at, self.width, self.drawn = 0, 0.0, 0, -1e9, 0, 0

    def update(self, step, loss):
        if not self.active:
            return
        now = self.clock()
        self.loss_sum, self.count, self.step = self.loss_sum + float(loss), self.count + 1, step
        if self.first_done is None:
            self.first_done, self.first_step = now, step
            self.out.write(f"first step: {now - self.start:.1f} s (it traces the step function; "
                           "the times below leave it out)\n")
            self.out.flush()
            if step < self.target:
                return
        if now - self.shown_at >= self.interval or step >= self.target:
            self.shown_at = now
            self._draw(now, final=step >= self.target)

    def line(self, now):
        """The text of the progress line at time ``now``."""
        digits = len(str(self.target))
        done = int(self.WIDTH * min(self.step, self.target) / max(self.target, 1))
        text = f"{self.step:>{digits}}/{self.target} [{'=' * done}{'.' * (self.WIDTH - done)}]"
        after = self.step - self.first_step
        if after > 0:
            per_step = (now - self.first_done) / after
            if self.step >= self.target:
                text += f" - {now - self.start:.0f} s"
            else:
                text += f" - {_clock(per_step * (self.target - self.step))} left"
            text += f" - {per_step * 1000:.0f} ms/step"
        text += f" - loss: {self.loss_sum / self.count:.4f}"
        if after > 0:
            text += f" - {self.images_per_step / max(per_step, 1e-9):.0f} images/s"
        return text

    def _draw(self, now, final=False):
        text = self.line(now)
        if self.out.isatty():
            text += " " * max(0, self.width - len(text))  # cover a longer previous line
        self.width, self.drawn = len(text), self.step
        self.out.write("\r" + text + ("\n" if final else ""))
        self.out.flush()

    def end(self):
        """End the line if the loop stopped before ``target`` (``update`` ends it at ``target``)."""
        if not self.active or not self.first_done or self.step >= self.target:
            return
        if self.drawn != self.step:
            self._draw(self.clock(), final=True)
        else:
            self.out.write("\n")
            self.out.flush()


def _clock(seconds):
    """``h:mm:ss``, ``m:ss`` or ``Ns``."""
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
    if seconds >= 60:
        return f"{seconds // 60}:{seconds % 60:02d}"
    return f"{seconds}s"


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

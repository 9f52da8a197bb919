# Horovod's TensorFlow 2 Keras example (examples/tensorflow2/tensorflow2_keras_mnist.py), as a Horovod
# user runs it:  horovodrun -np 2 python tensorflow2_keras_mnist.py  (with TF_USE_LEGACY_KERAS=1 and
# tf_keras for Keras 2).  It knows nothing about sdp; tests/test_tf_fidelity.py runs it with
#     TF_USE_LEGACY_KERAS=1 sdprun --compat horovod -np 2 python <this file>
# The pattern kept: a Sequential without an Input (its weights exist after the first batch),
# DistributedOptimizer, BroadcastGlobalVariablesCallback + MetricAverageCallback +
# LearningRateWarmupCallback, a ModelCheckpoint on rank 0, model.fit.  Changes from Horovod's file:
# MNIST read from the IDX files in $MNIST_DIR (no network here; Horovod downloads with
# tf.keras.datasets.mnist.load_data, used here when MNIST_DIR is unset), 8/16 filters instead of
# 32/64, and $EPOCHS (default 2) epochs of $STEPS (default 16) steps instead of 24 of 500 // size,
# so that a 2-core machine finishes in under a minute; a last line printing a weights checksum.
import gzip
import hashlib
import os
import sys

import numpy as np
import tensorflow as tf
import horovod.tensorflow.keras as hvd

# Horovod: initialize Horovod.
hvd.init()


def load_mnist():
    data_dir = os.environ.get("MNIST_DIR")
    if not data_dir:
        (images, labels), _ = tf.keras.datasets.mnist.load_data(path='mnist-%d.npz' % hvd.rank())
        return images, labels
    with gzip.open(os.path.join(data_dir, "train-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)
    with gzip.open(os.path.join(data_dir, "train-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    return images, labels


mnist_images, mnist_labels = load_mnist()

dataset = tf.data.Dataset.from_tensor_slices(
    (tf.cast(mnist_images[..., tf.newaxis] / 255.0, tf.float32),
     tf.cast(mnist_labels, tf.int64))
)
dataset = dataset.repeat().shuffle(10000).batch(128)

mnist_model = tf.keras.Sequential([
    tf.keras.layers.Conv2D(8, [3, 3], activation='relu'),
    tf.keras.layers.Conv2D(16, [3, 3], activation='relu'),
    tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
    tf.keras.layers.Dropout(0.25),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(128, activation='relu'),
    tf.keras.layers.Dropout(0.5),
    tf.keras.layers.Dense(10, activation='softmax')
])

# Horovod: adjust learning rate based on number of GPUs.
scaled_lr = 0.001 * hvd.size()
opt = tf.optimizers.Adam(scaled_lr)

# Horovod: add Horovod DistributedOptimizer.
opt = hvd.DistributedOptimizer(
    opt, backward_passes_per_step=1, average_aggregated_gradients=True)

# Horovod: Specify `experimental_run_tf_function=False` to ensure TensorFlow
# uses hvd.DistributedOptimizer() to compute gradients.
mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(),
                    optimizer=opt,
                    metrics=['accuracy'],
                    experimental_run_tf_function=False)

callbacks = [
    # Horovod: broadcast initial variable states from rank 0 to all other processes.
    # This is necessary to ensure consistent initialization of all workers when
    # training is started with random weights or restored from a checkpoint.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),

    # Horovod: average metrics among workers at the end of every epoch.
    #
    # Note: This callback must be in the list before the ReduceLROnPlateau,
    # TensorBoard or other metrics-based callbacks.
    hvd.callbacks.MetricAverageCallback(),

    # Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads to worse final accuracy.
    # Scale the learning rate `lr = 1.0` ---> `lr = 1.0 * hvd.size()` during the first
    # three epochs. See https://arxiv.org/abs/1706.02677 for details.
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
]

# Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
if hvd.rank() == 0:
    callbacks.append(tf.keras.callbacks.ModelCheckpoint('./checkpoint-{epoch}.h5'))

# Horovod: write logs on worker 0.
verbose = 1 if hvd.rank() == 0 else 0

# Train the model.
# Horovod: adjust number of steps based on number of GPUs.
history = mnist_model.fit(dataset, steps_per_epoch=int(os.environ.get("STEPS", 16)), callbacks=callbacks,
                          epochs=int(os.environ.get("EPOCHS", 2)), verbose=verbose)

digest = hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in mnist_model.get_weights())).hexdigest()
print("KERAS_MNIST rank %d keras %s loss %s weights %s" % (hvd.rank(), tf.keras.__name__.split(".")[0],
      ",".join("%.4f" % v for v in history.history["loss"]), digest[:16]), flush=True)
sys.exit(0)

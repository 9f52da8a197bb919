# Horovod's elastic TensorFlow 2 example (examples/elastic/tensorflow2/tensorflow2_mnist_elastic.py),
# as a Horovod user runs it:  horovodrun -np 2 --min-np 2 --host-discovery-script ./discover.sh python ...
# It knows nothing about sdp; tests/test_elastic_mp.py runs it with
#     sdprun --compat horovod -np 2 --min-np 2 --max-np 3 --host-discovery-script ... python <this file>
# Changes from Horovod's file: synthetic MNIST-shaped data instead of a download (no network here),
# opt.learning_rate instead of Keras 2's opt.lr, 4000 batches (not 10000; 600 let a 2-core box finish
# in ~1.5 s, before a slot added at batch 10 could be noticed), a last line printing a weights
# checksum per rank, and SDP_TEST_STOP_AT_SIZE=N: stop 10 committed batches after the job reached N
# workers (what the tests check has happened by then; the rest of the 4000 batches took ~20 s).
import hashlib
import os

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

hvd.init()

rng = np.random.default_rng(hvd.rank())
mnist_images = rng.integers(0, 255, size=(2000, 28, 28), dtype=np.uint8)
mnist_labels = (mnist_images.mean(axis=(1, 2)) > 127).astype(np.int64)

dataset = tf.data.Dataset.from_tensor_slices(
    (tf.cast(mnist_images[..., tf.newaxis] / 255.0, tf.float32),
     tf.cast(mnist_labels, tf.int64))
)
dataset = dataset.repeat().shuffle(1000).batch(32)

mnist_model = tf.keras.Sequential([
    tf.keras.layers.Input(shape=(28, 28, 1)),
    tf.keras.layers.Conv2D(8, [3, 3], activation='relu'),
    tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(32, activation='relu'),
    tf.keras.layers.Dense(10, activation='softmax')
])
loss = tf.losses.SparseCategoricalCrossentropy()

STOP_AT_SIZE = int(os.environ.get("SDP_TEST_STOP_AT_SIZE", "0"))

# Horovod: adjust learning rate based on number of GPUs.
lr = 0.001
opt = tf.optimizers.Adam(lr * hvd.size())


@tf.function
def training_step(images, labels, allreduce=True):
    with tf.GradientTape() as tape:
        probs = mnist_model(images, training=True)
        loss_value = loss(labels, probs)

    # Horovod: add Horovod Distributed GradientTape.
    if allreduce:
        tape = hvd.DistributedGradientTape(tape)

    grads = tape.gradient(loss_value, mnist_model.trainable_variables)
    opt.apply_gradients(zip(grads, mnist_model.trainable_variables))
    return loss_value


# Horovod: initialize model and optimizer state so we can synchronize across workers
for batch_idx, (images, labels) in enumerate(dataset.take(1)):
    training_step(images, labels, allreduce=False)


@hvd.elastic.run
def train(state):
    start_batch = state.batch

    # Horovod: adjust number of steps based on number of GPUs.
    for batch_idx, (images, labels) in enumerate(dataset.skip(state.batch).take(4000 // hvd.size())):
        state.batch = start_batch + batch_idx
        loss_value = training_step(images, labels)

        if state.batch % 10 == 0 and hvd.local_rank() == 0:
            print('Step #%d\tLoss: %.6f' % (state.batch, loss_value), flush=True)

        # Horovod: commit state at the end of each batch
        state.commit()
        if STOP_AT_SIZE and hvd.size() >= STOP_AT_SIZE and batch_idx >= 10:
            break  # (the same batch on every rank: all started this run from one commit)


def on_state_reset():
    # Horovod: update learning rate based on number of GPUs.
    opt.learning_rate.assign(lr * hvd.size())


state = hvd.elastic.TensorFlowKerasState(mnist_model, opt, batch=0)
state.register_reset_callbacks([on_state_reset])
train(state)

flat = np.concatenate([v.numpy().ravel() for v in mnist_model.variables])
print('DONE rank %d size %d weights %s' % (hvd.rank(), hvd.size(), hashlib.sha256(flat.tobytes()).hexdigest()[:16]),
      flush=True)

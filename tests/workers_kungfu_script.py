"""An unmodified KungFu-style TensorFlow 2 script (tests/test_kungfu_bridge_compat.py runs it with
``sdprun --compat kungfu -np 2``): every import names ``kungfu``."""
import numpy as np
import tensorflow as tf
from kungfu.python import current_cluster_size, current_rank, run_barrier
from kungfu.tensorflow.initializer import broadcast_variables
from kungfu.tensorflow.ops import all_reduce
from kungfu.tensorflow.optimizers import SynchronousSGDOptimizer

tf.keras.utils.set_random_seed(current_rank())
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(3), tf.keras.layers.Dense(1)])
opt = SynchronousSGDOptimizer(tf.keras.optimizers.SGD(0.01 * current_cluster_size()))
x = tf.constant(np.random.default_rng(current_rank()).normal(size=(16, 4)).astype(np.float32))


@tf.function
def training_step(first_batch):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x, training=True)))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    if first_batch:
        broadcast_variables(model.variables)
        broadcast_variables(opt.variables())
    return loss


for batch in range(5):
    training_step(batch == 0)
run_barrier()
flat = tf.concat([tf.reshape(v, [-1]) for v in model.trainable_variables], 0)
spread = all_reduce(flat, op='max') - all_reduce(flat, op='min')
import kungfu.python  # noqa: E402
print(f"kungfu module: {kungfu.python.__name__}")
print(f"rank {current_rank()} of {current_cluster_size()}: max spread {float(tf.reduce_max(spread)):.3g}")

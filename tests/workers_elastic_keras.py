# Worker of tests/test_elastic_mp.py: Horovod's Keras elastic pattern (model.fit with KerasState and the three
# elastic callbacks) under --compat horovod; worker 2 SIGKILLs itself in epoch 1 after batch 5.
import os, signal, hashlib
import numpy as np
import tensorflow as tf
import horovod.tensorflow.keras as hvd

hvd.init()
rng = np.random.default_rng(0)
x = rng.random((4096, 8), dtype=np.float32); y = (x.sum(1) > 4).astype(np.int64)
model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(16, activation="relu"), tf.keras.layers.Dense(2)])
opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01))
model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))

class Die(tf.keras.callbacks.Callback):
    def on_batch_end(self, batch, logs=None):
        if os.environ.get("SDP_ELASTIC_WORKER") == "2" and state.epoch == 1 and batch == 5:
            os.kill(os.getpid(), signal.SIGKILL)

state = hvd.elastic.KerasState(model, batch=0, epoch=0)
callbacks = [hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
             hvd.elastic.CommitStateCallback(state, batches_per_commit=4), Die()]

@hvd.elastic.run
def train(state):
    model.fit(x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()], steps_per_epoch=20, batch_size=32,
              callbacks=callbacks, epochs=3 - state.epoch, verbose=0)

train(state)
flat = np.concatenate([v.numpy().ravel() for v in model.variables])
print("DONE", hvd.rank(), hvd.size(), state.epoch, hashlib.sha256(flat.tobytes()).hexdigest()[:12], flush=True)

# A Horovod user's TensorFlow test file for what a script notices beyond the collectives' values:
# gradients of every collective, TensorFlow's error classes, the worker environment horovodrun
# exports, Horovod's runner/common helper modules, and the Keras broadcast callback with a model
# built by its first batch.  Written the way Horovod's own tests are (tf.test.TestCase, hvd.init()
# in every test, graph and eager variants); it knows nothing about sdp:
#     sdprun --compat horovod -np 2 python -m pytest tests/horovod_user/test_tensorflow_hvd_fidelity.py
import os

import numpy as np
import tensorflow as tf
from tensorflow.python.framework.test_util import run_in_graph_and_eager_modes

import horovod.tensorflow as hvd
from horovod.common.util import is_version_greater_equal_than
from horovod.runner.common.util import env as hvd_env
from horovod.tensorflow.util import _executing_eagerly


class TensorFlowFidelityTests(tf.test.TestCase):

    def evaluate(self, tensors):
        if _executing_eagerly():
            return tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, tensors)
        return super().evaluate(tensors)

    def _grad(self, build, value, grad_ys):
        """Gradient of build(x) at x = value with upstream gradient grad_ys, eagerly or in a graph."""
        if _executing_eagerly():
            x = tf.Variable(value)
            with tf.GradientTape() as tape:
                y = build(x)
            return tape.gradient(y, x, grad_ys).numpy()
        x = tf.constant(value)
        y = build(x)
        return self.evaluate(tf.gradients(y, x, grad_ys)[0])

    @run_in_graph_and_eager_modes
    def test_horovod_allgather_grad_cpu(self):
        """Rank r gathers r + 1 rows; the gradient is this rank's rows of the averaged gradient."""
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        total = size * (size + 1) // 2
        grad_ys = tf.ones([total, 2]) * (rank + 1)
        grad = self._grad(hvd.allgather, np.ones([rank + 1, 2], np.float32), grad_ys)
        self.assertAllClose(grad, np.full([rank + 1, 2], (size + 1) / 2.0))

    @run_in_graph_and_eager_modes
    def test_horovod_broadcast_grad_cpu(self):
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        for root_rank in range(size):
            grad = self._grad(lambda x: hvd.broadcast(x, root_rank), np.full([5, 5], rank, np.float32),
                              tf.ones([5, 5]))
            self.assertAllClose(grad, np.ones([5, 5]) * (1 if rank == root_rank else 0))

    @run_in_graph_and_eager_modes
    def test_horovod_alltoall_grad_cpu(self):
        """Rank r sends r + 1 rows to every rank; the gradient comes back along the same rows."""
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        splits = [rank + 1] * size
        value = np.full([(rank + 1) * size, 2], rank, np.float32)
        grad_ys = tf.ones([size * (size + 1) // 2, 2])
        grad = self._grad(lambda x: hvd.alltoall(x, splits=splits)[0], value, grad_ys)
        self.assertAllClose(grad, np.ones_like(value))

    @run_in_graph_and_eager_modes
    def test_horovod_reducescatter_grad_cpu(self):
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        for op, scale in ((hvd.Sum, size), (hvd.Average, 1)):
            grad = self._grad(lambda x: hvd.reducescatter(x, op=op), np.ones([size * 2, 3], np.float32),
                              tf.ones([2, 3]))
            self.assertAllClose(grad, np.ones([size * 2, 3]) * scale)

    @run_in_graph_and_eager_modes
    def test_horovod_allreduce_error(self):
        """Different shapes on different ranks: FailedPreconditionError, as Horovod's kernels say."""
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        if size == 1:
            self.skipTest("Only one worker available")
        with self.assertRaises(tf.errors.FailedPreconditionError):
            self.evaluate(hvd.allreduce(tf.ones([17] * (rank + 1))))

    @run_in_graph_and_eager_modes
    def test_horovod_broadcast_rank_error(self):
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        if size == 1:
            self.skipTest("Only one worker available")
        with self.assertRaises(tf.errors.FailedPreconditionError):
            self.evaluate(hvd.broadcast(tf.ones([17] * 3), rank))

    @run_in_graph_and_eager_modes
    def test_horovod_alltoall_splits_error(self):
        hvd.init()
        size = hvd.size()
        with self.assertRaises(tf.errors.InvalidArgumentError):
            self.evaluate(hvd.alltoall(tf.ones([size * 2, 2]), splits=[1] * size))

    def test_horovod_environment(self):
        """horovodrun's worker variables, and the helper Horovod's tests read them with."""
        hvd.init()
        self.assertEqual(int(os.environ["HOROVOD_RANK"]), hvd.rank())
        self.assertEqual(int(os.environ["HOROVOD_SIZE"]), hvd.size())
        self.assertEqual(int(os.environ["HOROVOD_LOCAL_RANK"]), hvd.local_rank())
        self.assertEqual(int(os.environ["HOROVOD_LOCAL_SIZE"]), hvd.local_size())
        self.assertEqual(int(os.environ["HOROVOD_CROSS_RANK"]), hvd.cross_rank())
        self.assertEqual(int(os.environ["HOROVOD_CROSS_SIZE"]), hvd.cross_size())
        self.assertTrue(os.environ["HOROVOD_HOSTNAME"])
        self.assertEqual(hvd_env.get_env_rank_and_size(), (hvd.rank(), hvd.size()))
        self.assertTrue(is_version_greater_equal_than(tf.__version__, "2.0.0"))

    def test_horovod_keras_lazy_model_broadcast(self):
        """A Sequential without an Input is built by its first batch: the callback broadcasts then."""
        import horovod.tensorflow.keras as hvd_keras
        hvd_keras.init()
        rank = hvd_keras.rank()
        tf.random.set_seed(rank)
        model = tf.keras.Sequential([tf.keras.layers.Dense(4, activation="relu"), tf.keras.layers.Dense(1)])
        model.compile(optimizer=hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)), loss="mse")
        x = np.full([8, 3], rank + 1.0, np.float32)
        y = np.ones([8, 1], np.float32)
        model.fit(x, y, batch_size=4, epochs=1, verbose=0,
                  callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
        for w in model.get_weights():
            self.assertAllClose(hvd.broadcast(tf.constant(w), 0).numpy(), w)


if __name__ == "__main__":
    tf.test.main()

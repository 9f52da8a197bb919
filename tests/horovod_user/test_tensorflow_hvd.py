# A Horovod user's TensorFlow test file, written the way Horovod's own tests are: a tf.test.TestCase,
# hvd.init() at the top of every test, graph and eager variants through TensorFlow's
# run_in_graph_and_eager_modes, helpers from horovod.tensorflow.util and horovod.runner.util.threads.
# It knows nothing about sdp: run it with
#     sdprun --compat horovod -np 2 python -m pytest tests/horovod_user/test_tensorflow_hvd.py
import itertools
import threading

import numpy as np
import tensorflow as tf
from tensorflow.python.framework.test_util import run_in_graph_and_eager_modes

import horovod.tensorflow as hvd
from horovod.runner.util.threads import in_thread
from horovod.tensorflow.util import _executing_eagerly


class TensorFlowTests(tf.test.TestCase):
    """Collectives over every rank of the job; each rank runs the same tests in the same order."""

    def evaluate(self, tensors):
        if _executing_eagerly():
            return tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, tensors)
        return super().evaluate(tensors)

    def test_horovod_rank_and_size(self):
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        self.assertGreaterEqual(rank, 0)
        self.assertLess(rank, size)
        self.assertTrue(hvd.is_initialized())
        self.assertLess(hvd.local_rank(), hvd.local_size())

    def test_horovod_init_twice(self):
        hvd.init()
        rank = hvd.rank()
        hvd.init()
        self.assertEqual(hvd.rank(), rank)

    @run_in_graph_and_eager_modes
    def test_horovod_allreduce_cpu(self):
        """Sum over ranks of the same tensor is size times the tensor."""
        hvd.init()
        size = hvd.size()
        dtypes = [tf.int32, tf.int64, tf.float32, tf.float64]
        dims = [1, 2, 3]
        for dtype, dim in itertools.product(dtypes, dims):
            with tf.device("/cpu:0"):
                tensor = tf.cast(tf.reshape(tf.range(4 ** dim), [4] * dim) % 7, dtype)
                summed = hvd.allreduce(tensor, average=False)
            multiplied = tensor * size
            max_difference = tf.reduce_max(tf.abs(summed - multiplied))
            diff = self.evaluate(max_difference)
            self.assertEqual(diff, 0, f"hvd.allreduce produces incorrect results for {dtype.name}, dim {dim}")

    @run_in_graph_and_eager_modes
    def test_horovod_allreduce_average_cpu(self):
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        with tf.device("/cpu:0"):
            tensor = tf.fill([3, 2], float(rank))
            averaged = hvd.allreduce(tensor, op=hvd.Average)
        result = self.evaluate(averaged)
        self.assertAllClose(result, np.full([3, 2], (size - 1) / 2.0))

    @run_in_graph_and_eager_modes
    def test_horovod_allreduce_fp16_compression(self):
        hvd.init()
        size = hvd.size()
        tensor = tf.constant([1.0, 2.0, 3.0], tf.float32)
        summed = hvd.allreduce(tensor, average=False, compression=hvd.Compression.fp16)
        self.assertEqual(summed.dtype, tf.float32)
        self.assertAllClose(self.evaluate(summed), [1.0 * size, 2.0 * size, 3.0 * size])

    def test_horovod_allreduce_grad_cpu(self):
        """The gradient of an allreduce (Sum) is the allreduce of the incoming gradient."""
        hvd.init()
        size = hvd.size()
        for dim in [1, 2, 3]:
            tensor = tf.Variable(tf.ones([5] * dim))
            with tf.GradientTape() as tape:
                summed = hvd.allreduce(tensor, average=False)
            grad_out = tape.gradient(summed, tensor, tf.ones([5] * dim))
            self.assertAllClose(grad_out.numpy(), np.ones([5] * dim) * size)

    @run_in_graph_and_eager_modes
    def test_horovod_allgather_cpu(self):
        """Rank r contributes r + 1 rows filled with r."""
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        for dtype in [tf.uint8, tf.int32, tf.float32, tf.float64, tf.bool]:
            tensor = tf.cast(tf.fill([rank + 1, 3], rank), dtype)
            gathered = self.evaluate(hvd.allgather(tensor))
            expected = np.concatenate([np.full([r + 1, 3], r) for r in range(size)]).astype(dtype.as_numpy_dtype)
            self.assertAllEqual(gathered, expected)

    @run_in_graph_and_eager_modes
    def test_horovod_broadcast_cpu(self):
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        for root_rank in range(size):
            tensor = tf.fill([2, 3], rank)
            broadcasted = self.evaluate(hvd.broadcast(tensor, root_rank))
            self.assertAllEqual(broadcasted, np.full([2, 3], root_rank))

    def test_horovod_broadcast_variables(self):
        hvd.init()
        rank = hvd.rank()
        variables = [tf.Variable(tf.fill([4], float(rank))), tf.Variable(rank)]
        hvd.broadcast_variables(variables, root_rank=0)
        self.assertAllEqual(variables[0].numpy(), np.zeros(4))
        self.assertEqual(int(variables[1].numpy()), 0)

    def test_horovod_grouped_allreduce_cpu(self):
        hvd.init()
        size = hvd.size()
        tensors = [tf.ones([2, 2]) * (i + 1) for i in range(5)]
        summed = hvd.grouped_allreduce(tensors, average=False)
        for i, s in enumerate(summed):
            self.assertAllClose(s.numpy(), np.ones([2, 2]) * (i + 1) * size)

    @run_in_graph_and_eager_modes
    def test_horovod_size_op(self):
        hvd.init()
        self.assertEqual(self.evaluate(hvd.size_op()), hvd.size())
        self.assertEqual(self.evaluate(hvd.rank_op()), hvd.rank())

    @run_in_graph_and_eager_modes
    def test_horovod_alltoall_cpu(self):
        """Equal splits: rank r sends one row of value r to every rank and gets one from each."""
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        tensor = tf.fill([size, 2], rank)
        received = self.evaluate(hvd.alltoall(tensor))
        self.assertAllEqual(received, np.repeat(np.arange(size), 2).reshape(size, 2))

    @run_in_graph_and_eager_modes
    def test_horovod_reducescatter_cpu(self):
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        tensor = tf.ones([size * 2, 3]) * (rank + 1)
        scattered = self.evaluate(hvd.reducescatter(tensor, op=hvd.Sum))
        self.assertAllClose(scattered, np.full([2, 3], size * (size + 1) / 2.0))

    def test_distributed_gradient_tape(self):
        """Averaged gradients: rank r's loss is (r + 1) * sum(w)."""
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        w = tf.Variable(tf.ones([3]))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w) * (rank + 1)
        tape = hvd.DistributedGradientTape(tape)
        (grad,) = tape.gradient(loss, [w])
        self.assertAllClose(grad.numpy(), np.full([3], (size + 1) / 2.0))

    def test_horovod_allreduce_in_thread(self):
        """Collectives may be called from another thread than the one that called init()."""
        hvd.init()
        size = hvd.size()
        results = {}
        done = threading.Event()

        def work():
            results["sum"] = hvd.allreduce(tf.constant([1.0, 1.0]), average=False).numpy()
            done.set()

        thread = in_thread(work, daemon=True)
        thread.join(60)
        self.assertTrue(done.is_set())
        self.assertAllClose(results["sum"], [float(size), float(size)])


if __name__ == "__main__":
    tf.test.main()

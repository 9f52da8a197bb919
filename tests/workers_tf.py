"""TensorFlow workers for tests/test_tensorflow_mp.py (run inside real rank processes)."""
import numpy as np


def tape_in_tf_function(steps):
    import tensorflow as tf

    import sdp.tensorflow as hvd
    r, n = hvd.rank(), hvd.size()
    w = tf.Variable(tf.ones([3, 2]) * (r + 1.0))  # differs per rank until broadcast
    x = tf.constant(np.arange(6, dtype=np.float32).reshape(2, 3) + r)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.matmul(x, w) ** 2)
        tape = hvd.DistributedGradientTape(tape)
        return tape.gradient(loss, [w])[0]

    hvd.broadcast_variables([w], root_rank=0)
    grads = [step().numpy() for _ in range(steps)]
    return {"w": w.numpy().tolist(), "grad": grads[-1].tolist()}


def fp16_wire_dtype():
    import tensorflow as tf

    import sdp.tensorflow as hvd
    from sdp.tensorflow.compression import gradient_compression
    x = tf.constant([1.0, 2.0])
    wire, _ = gradient_compression(hvd.Compression.fp16).compress(x)  # what tapes/optimizers send
    contract, _ = hvd.Compression.fp16.compress(x)  # Horovod's contract: always float16
    out = hvd.allreduce(x, compression=hvd.Compression.fp16, op=hvd.Sum)
    return [wire.dtype.name, contract.dtype.name, out.dtype.name, out.numpy().tolist()]

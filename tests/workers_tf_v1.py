"""Workers for tests/test_tf_v1.py: TF1-style graphs (tf.compat.v1) with MonitoredTrainingSession,
BroadcastGlobalVariablesHook and DistributedOptimizer over tf.compat.v1.train optimizers."""
import numpy as np

BATCH = 4


def _shard(rank, steps, features=3):
    rng = np.random.default_rng(5 + rank)
    x = rng.normal(size=(steps * BATCH, features)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]], np.float32) + 0.1 * rank).astype(np.float32)
    return x, y


def _reference_gd(w0, size, steps, lr, passes_per_step=1):
    """Plain gradient descent on the concatenated batches (numpy), accumulating and averaging over
    ``passes_per_step`` passes like backward_passes_per_step with average_aggregated_gradients."""
    shards = [_shard(r, steps) for r in range(size)]
    w = w0.astype(np.float64)
    acc = np.zeros_like(w)
    for i in range(steps):
        x = np.concatenate([s[0][i * BATCH:(i + 1) * BATCH] for s in shards])
        y = np.concatenate([s[1][i * BATCH:(i + 1) * BATCH] for s in shards])
        acc += 2.0 / len(x) * x.T @ (x @ w - y)
        if (i + 1) % passes_per_step == 0:
            w = w - lr * acc / passes_per_step
            acc[:] = 0
    return w


def monitored_session(steps, passes_per_step):
    import tensorflow as tf

    import sdp.tensorflow as hvd
    r, n = hvd.rank(), hvd.size()
    x_all, y_all = _shard(r, steps)
    out = {}
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(100 + r)  # different initial weights per rank
        x = tf.compat.v1.placeholder(tf.float32, [None, 3])
        y = tf.compat.v1.placeholder(tf.float32, [None, 1])
        w = tf.compat.v1.get_variable("w", [3, 1], initializer=tf.compat.v1.random_normal_initializer())
        loss = tf.reduce_mean((tf.matmul(x, w) - y) ** 2)
        global_step = tf.compat.v1.train.get_or_create_global_step()
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.05), bucket_cap_mb=1,
                                       backward_passes_per_step=passes_per_step,
                                       average_aggregated_gradients=True)
        train_op = opt.minimize(loss, global_step=global_step)
        rank_t, size_t = hvd.rank_op(), hvd.size_op()
        summed = hvd.allreduce(tf.cast(rank_t, tf.float32) + 1.0, op=hvd.Sum)
        hooks = [hvd.BroadcastGlobalVariablesHook(0)]
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
            out["w0"] = sess.run(w).tolist()
            for i in range(steps):
                sess.run(train_op, feed_dict={x: x_all[i * BATCH:(i + 1) * BATCH], y: y_all[i * BATCH:(i + 1) * BATCH]})
            out["w"] = sess.run(w).tolist()
            out["global_step"] = int(sess.run(global_step))
            out["ops"] = [int(v) for v in sess.run([rank_t, size_t])] + [float(sess.run(summed))]
    from sdp import api
    out["fusion_threshold"] = api.fusion_threshold()
    if r == 0:
        out["reference"] = _reference_gd(np.asarray(out["w0"]), n, steps, 0.05, passes_per_step).tolist()
    return out

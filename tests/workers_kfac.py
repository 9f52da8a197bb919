"""Workers for tests/test_kfac.py: K-FAC training steps on real ranks (sdp.tensorflow.kfac)."""
import numpy as np

GLOBAL_BATCH = 12


def _data(steps):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((steps, GLOBAL_BATCH, 6, 6, 1)).astype(np.float32)
    y = rng.integers(0, 3, (steps, GLOBAL_BATCH)).astype(np.int64)
    return x, y


def _model(tf):
    tf.keras.utils.set_random_seed(3)  # the same weights on every rank (and in the 1-rank run)
    layers = tf.keras.layers
    return tf.keras.Sequential([tf.keras.Input(shape=(6, 6, 1)),
                                layers.Conv2D(3, 3, padding="same", activation="relu"),
                                layers.MaxPooling2D(2), layers.Flatten(),
                                layers.Dense(4, activation="tanh"), layers.LayerNormalization(),
                                layers.Dense(3)])


def train(steps, strategies):
    """``steps`` K-FAC steps per strategy on this rank's slice of a fixed global batch; returns
    {strategy: {"weights": [flat float list], "owners": [...], "timings": {...}}}."""
    import tensorflow as tf

    import sdp.tensorflow as hvd
    from sdp.tensorflow import kfac
    r, n = hvd.rank(), hvd.size()
    per = GLOBAL_BATCH // n
    x, y = _data(steps)
    out = {}
    for strategy in strategies:
        model = _model(tf)
        opt = kfac.KfacOptimizer(model, tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                                 learning_rate=0.05, damping=1e-2, cov_ema_decay=0.8, momentum=0.9,
                                 norm_constraint=1.0, inv_update_every=2, strategy=strategy)
        for s in range(steps):
            opt.step(tf.constant(x[s, r * per:(r + 1) * per]), tf.constant(y[s, r * per:(r + 1) * per]))
        flat = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
        out[strategy] = {"weights": flat.astype(np.float64).tolist(), "owners": opt.owners,
                         "timings": opt.timings}
    return out

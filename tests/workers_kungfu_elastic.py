"""Elastic worker for tests/test_kungfu_elastic.py, run under ``sdprun -w`` (numpy only, fast).

    python workers_kungfu_elastic.py SCHEDULE_JSON MAX_STEP [resize|propose|tf]

Trains a toy model (4 weights, gradient averaged over the cluster) for MAX_STEP steps; after step
s in SCHEDULE (``{"3": 3, "6": 1}``) the cluster is resized: by ``resize(n)`` on every worker
(mode ``resize``), or by rank 0 proposing the size to the config server and every worker calling
``resize()`` after every step (mode ``propose``).  After a change (and on a new worker's start)
rank 0's step and weights are broadcast: KungFu's elastic pattern.  Prints one JSON line per
step: uid, rank, size, step, a digest of the weights.  Mode ``tf`` does the same with a Keras
model, ``SynchronousSGDOptimizer`` in a ``tf.function``, the ``resize`` TF operator and
``broadcast_variables``.
"""
import hashlib
import json
import os
import sys

import numpy as np

import sdp_kungfu_bridge.python as kf
from sdp import api


def main():
    schedule = {int(k): v for k, v in json.loads(sys.argv[1]).items()}
    max_step = int(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else "resize"
    if mode == "tf":
        return main_tf(schedule, max_step)
    me = kf.uid()
    w = np.random.default_rng(me % (1 << 32)).normal(size=4)  # differs until the first sync
    step, need_sync = 0, True
    while step < max_step:
        if need_sync:
            step = int(api.broadcast(np.array(step, np.int64), 0, name="sync.step"))
            w = api.broadcast(w, 0, name="sync.weights")
            need_sync = False
        g = api.allreduce(w - kf.current_rank(), name="grad")  # average over the cluster
        w = w - 0.1 * g
        step += 1
        print(json.dumps({"uid": me, "rank": kf.current_rank(), "size": kf.current_cluster_size(),
                          "step": step, "w": hashlib.sha256(w.tobytes()).hexdigest()[:16],
                          "host": os.environ.get("SDP_HOSTNAME")}), flush=True)
        if mode == "resize":
            changed, detached = kf.resize(schedule[step]) if step in schedule else (False, False)
        else:
            if step in schedule and kf.current_rank() == 0:
                kf.propose_new_size(schedule[step])
            changed, detached = kf.resize()
        if detached:
            print(json.dumps({"uid": me, "detached_at": step}), flush=True)
            return
        need_sync = changed
    kf.run_barrier()
    print(json.dumps({"uid": me, "done": step, "size": kf.current_cluster_size()}), flush=True)


def main_tf(schedule, max_step):
    import keras
    import tensorflow as tf

    from sdp_kungfu_bridge.tensorflow import initializer, ops, optimizers

    me = kf.uid()
    keras.utils.set_random_seed(me % (1 << 31))  # differs until the first sync
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    opt.build(model.trainable_variables)

    @tf.function
    def train_step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - 1.0))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    step, need_sync = 0, True
    while step < max_step:
        if need_sync:
            step = int(ops.broadcast(tf.constant(step, tf.int64)))
            initializer.broadcast_variables(model.variables + list(opt.variables))
            need_sync = False
        x = np.random.default_rng(step * 100 + kf.current_rank()).normal(size=(4, 3)).astype(np.float32)
        train_step(tf.constant(x))
        step += 1
        w = np.concatenate([v.numpy().ravel() for v in model.trainable_variables + list(opt.variables)])
        print(json.dumps({"uid": me, "rank": kf.current_rank(), "size": kf.current_cluster_size(),
                          "step": step, "w": hashlib.sha256(w.tobytes()).hexdigest()[:16]}), flush=True)
        if step in schedule:
            changed = bool(ops.resize(schedule[step]))
            if kf.detached():
                print(json.dumps({"uid": me, "detached_at": step}), flush=True)
                return
            need_sync = changed
    kf.run_barrier()
    print(json.dumps({"uid": me, "done": step, "size": kf.current_cluster_size()}), flush=True)


if __name__ == "__main__":
    main()

"""K-FAC (Kronecker-factored approximate curvature) for Keras models, data-parallel over sdp.

A TensorFlow 2 / Keras 3 successor of TensorFlow's TF1-only ``kfac`` library (``kfac.KfacOptimizer``,
last released 2022), distributed with sdp's collectives in the two ways of its distributed guide:

- ``strategy="chief"``: gradients and Kronecker factors are averaged over the ranks every step with
  one fused ``sdp.tensorflow.grouped_allreduce``; rank 0 computes every inverse and broadcasts it.
- ``strategy="split"``: the inversions are split into tasks (``inverse_tasks``): one per
  Kronecker factor (A and G of a layer apart), and a factor costing more than a rank's fair share is
  cut into column blocks of its inverse; each task belongs to one rank (balanced by cost,
  ``assign_inverse_owners``), which computes it and broadcasts it.  Each rank keeps a moving
  average of its *own* factors; these are averaged only on the steps that refresh the inverses.
  The average is linear, so this equals the moving average of averaged factors.

Papers: Martens & Grosse 2015, "Optimizing Neural Networks with Kronecker-factored Approximate
Curvature" (K-FAC, factored Tikhonov damping, sec. 6.3); Grosse & Martens 2016, "A
Kronecker-factored approximate Fisher matrix for convolution layers" (KFC); Ba, Grosse & Martens
2017, "Distributed second-order optimization using Kronecker-factored approximations" (the
``norm_constraint`` / KL clip of the update).

For a ``Dense`` layer with kernel W (d_in, d_out) and bias b (d_out,), the gradient block is
M = [dW; db] of shape (d_in + 1, d_out), and the Fisher block is approximated as F = G ⊗ A, with

- A = E[ā āᵀ], (d_in + 1, d_in + 1): ā is the layer input with a trailing 1 (the bias column);
- G = E[g gᵀ], (d_out, d_out): g = ∂ℓ_i/∂s_i, the gradient of example i's loss by the layer's
  pre-activation s, with the label y_i sampled from the model's predictive distribution (the true
  Fisher, ``estimation_mode="gradients"``, as the ``kfac`` library does by default) or the true label
  (the empirical Fisher, ``estimation_mode="empirical"``).

The preconditioned gradient is (G + γ_G I)⁻¹ ⊗ (A + γ_A I)⁻¹ vec(M) = (A + γ_A I)⁻¹ M (G + γ_G I)⁻¹
(vec stacks columns), with the damping split π-wise: γ_A = π √damping, γ_G = √damping / π,
π = √((tr A / dim A) / (tr G / dim G)).  A ``Conv2D`` layer with a (kh, kw, c_in, c_out) kernel
uses its input patches (``tf.image.extract_patches``): ā has kh·kw·c_in + 1 entries and A averages
over examples and output positions T; G = (1/B) Σ_{i,t} g_it g_itᵀ (sums over positions, KFC's
"spatially uncorrelated derivatives").  Layers of any other kind keep their plain gradient.

Supported models: ``keras.Sequential`` (run layer by layer so that each Dense/Conv2D pre-activation
can be differentiated); Dense on 2-D inputs, Conv2D with ``channels_last`` and ``groups=1``.
All factors are float32; inverses are computed in float64 and stored as float32.
"""
import time

import numpy as np
import tensorflow as tf

from sdp import api as _api
from sdp.common.reduce_ops import ReduceOp
from sdp.tensorflow import collectives as _coll

STRATEGIES = ("chief", "split")
"""The distribution strategies ``KfacOptimizer`` takes (see the module docstring)."""
TIMINGS = ("gradient", "factor", "inverse", "communication")
"""The phases ``KfacOptimizer.timings`` reports seconds for."""
ESTIMATION_MODES = ("empirical", "gradients")
"""The ways ``KfacOptimizer`` estimates the output-gradient factors (see the module docstring)."""


def dense_factors(inputs, output_grads, use_bias=True):
    """K-FAC factors of one Dense layer from one batch.

    ``inputs``: (B, d_in) layer inputs; ``output_grads``: (B, d_out) per-example gradients of the
    loss by the pre-activations.  Returns ``(A, G)``: A = āᵀā / B of shape (d_in + 1, d_in + 1)
    (d_in without bias), G = gᵀg / B of shape (d_out, d_out); float32."""
    a = tf.convert_to_tensor(inputs, tf.float32)
    g = tf.convert_to_tensor(output_grads, tf.float32)
    batch = tf.cast(tf.shape(a)[0], tf.float32)
    if use_bias:
        a = tf.concat([a, tf.ones_like(a[:, :1])], axis=1)
    return tf.matmul(a, a, transpose_a=True) / batch, tf.matmul(g, g, transpose_a=True) / batch


def conv2d_patches(inputs, kernel_size, strides, padding, dilation_rate):
    """The patches a Conv2D layer multiplies with its kernel: (B, H_out, W_out, kh·kw·c_in), with the
    last axis ordered like the kernel's first three axes (kh, kw, c_in)."""
    kh, kw = kernel_size
    return tf.image.extract_patches(inputs, sizes=[1, kh, kw, 1], strides=[1, *strides, 1],
                                    rates=[1, *dilation_rate, 1], padding=padding.upper())


def conv2d_factors(inputs, output_grads, kernel_size, strides=(1, 1), padding="valid",
                   dilation_rate=(1, 1), use_bias=True):
    """K-FAC factors of one Conv2D layer from one batch (KFC, Grosse & Martens 2016).

    ``inputs``: (B, H, W, c_in); ``output_grads``: (B, H_out, W_out, c_out) per-example gradients by
    the pre-activations.  Returns ``(A, G)``: A (kh·kw·c_in + 1 square) is the mean of ā āᵀ over
    examples and output positions; G (c_out square) is Σ_{i,t} g gᵀ / B; float32."""
    g = tf.convert_to_tensor(output_grads, tf.float32)
    patches = conv2d_patches(tf.convert_to_tensor(inputs, tf.float32), kernel_size, strides, padding,
                             dilation_rate)
    a = tf.reshape(patches, [-1, patches.shape[-1]])
    if use_bias:
        a = tf.concat([a, tf.ones_like(a[:, :1])], axis=1)
    batch = tf.cast(tf.shape(g)[0], tf.float32)
    g = tf.reshape(g, [-1, g.shape[-1]])
    return tf.matmul(a, a, transpose_a=True) / tf.cast(tf.shape(a)[0], tf.float32), \
        tf.matmul(g, g, transpose_a=True) / batch


def pi_damping(a, g, damping):
    """The factored Tikhonov damping ``(γ_A, γ_G)`` of one block (Martens & Grosse 2015, sec. 6.3):
    γ_A = π √damping, γ_G = √damping / π, π = √((tr A / dim A) / (tr G / dim G)); float64 scalars."""
    a = tf.cast(a, tf.float64)
    g = tf.cast(g, tf.float64)
    eps = 1e-12
    pi = tf.sqrt((tf.linalg.trace(a) / a.shape[0] + eps) / (tf.linalg.trace(g) / g.shape[0] + eps))
    root = tf.sqrt(tf.constant(damping, tf.float64))
    return pi * root, root / pi


def damped_cholesky(m, gamma):
    """The lower Cholesky factor L of M + γ I (M a symmetric PSD n x n factor, γ > 0), float64."""
    m = tf.cast(m, tf.float64)
    return tf.linalg.cholesky(m + tf.cast(gamma, tf.float64) * tf.eye(m.shape[0], dtype=tf.float64))


def inverse_columns(chol, lo, hi):
    """Columns ``lo:hi`` of (L Lᵀ)⁻¹ from the Cholesky factor ``chol`` = L (n, n): two triangular
    solves against those columns of I; (n, hi - lo) float32.  Cheaper than ``tf.linalg.inv`` even for
    all n columns (n³/3 + 2n³ flops, but about 23 ms against 30 ms at n = 785 on one core)."""
    n = chol.shape[0]
    return tf.cast(tf.linalg.cholesky_solve(chol, tf.eye(n, dtype=tf.float64)[:, lo:hi]), tf.float32)


def damped_inverse(m, gamma):
    """``(M + γ I)⁻¹`` of a square symmetric PSD factor M (via its Cholesky factor), computed in
    float64, returned as float32."""
    return inverse_columns(damped_cholesky(m, gamma), 0, m.shape[0])


def damped_inverses(a, g, damping):
    """``((A + γ_A I)⁻¹, (G + γ_G I)⁻¹)`` with the π-damping of ``pi_damping``; float32, shapes of
    A and G."""
    gamma_a, gamma_g = pi_damping(a, g, damping)
    return damped_inverse(a, gamma_a), damped_inverse(g, gamma_g)


def assign_inverse_owners(costs, size):
    """Owner rank of each inversion task: the costliest first, each to the least loaded rank (ties:
    the lowest rank); returns a list of ints in ``[0, size)``, one per entry of ``costs``.
    ``costs``: the tasks' costs (see ``inverse_tasks``).  Raises ``ValueError`` for size < 1."""
    if size < 1:
        raise ValueError(f"assign_inverse_owners: size must be >= 1, got {size}")
    load = [0.0] * size
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(size), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += costs[i]
    return owners


def _task_cost(n, k):
    """Flops of one task: the Cholesky factor of an n x n factor, then k columns of its inverse."""
    return n ** 3 / 3 + 2 * n * n * k


def inverse_tasks(dims, size):
    """Split the inversion of factors of sizes ``dims`` (n_j x n_j each) into tasks for ``size`` ranks.

    A factor costing more than a rank's fair share (total / size) is split into column blocks,
    ceil(cost / share) of them (at most ``size``); each block's owner computes the factor's Cholesky
    factor and those columns of the inverse (``inverse_columns``).  So the one 785 x 785 factor
    that dominates the example's convnet is no longer a floor under the busiest rank's time.
    Returns ``(tasks, owners)``: ``tasks`` a list of ``(j, lo, hi)``, whose blocks partition every
    factor's columns ``[0, n_j)`` exactly once; ``owners`` the rank of each task
    (``assign_inverse_owners``).  Raises ``ValueError`` for size < 1."""
    if size < 1:
        raise ValueError(f"inverse_tasks: size must be >= 1, got {size}")
    share = sum(_task_cost(n, n) for n in dims) / size
    tasks = []
    for j, n in enumerate(dims):
        blocks = max(1, min(size, n, -(-_task_cost(n, n) // share) if share else 1))
        edges = np.linspace(0, n, int(blocks) + 1).astype(int)
        tasks += [(j, int(lo), int(hi)) for lo, hi in zip(edges[:-1], edges[1:])]
    return tasks, assign_inverse_owners([_task_cost(dims[j], hi - lo) for j, lo, hi in tasks], size)


class _Block:
    """One registered layer: its kind, variables and factor sizes."""

    def __init__(self, index, layer):
        self.index, self.layer = index, layer
        self.kind = "conv2d" if isinstance(layer, tf.keras.layers.Conv2D) else "dense"
        self.use_bias = bool(layer.use_bias)
        self.variables = [layer.kernel] + ([layer.bias] if self.use_bias else [])
        kernel_shape = tuple(layer.kernel.shape)
        self.kernel_shape = kernel_shape
        self.n_in = int(np.prod(kernel_shape[:-1])) + (1 if self.use_bias else 0)
        self.n_out = int(kernel_shape[-1])

    def factors(self, inputs, output_grads):
        if self.kind == "dense":
            return dense_factors(inputs, output_grads, self.use_bias)
        lay = self.layer
        return conv2d_factors(inputs, output_grads, lay.kernel_size, lay.strides, lay.padding,
                              lay.dilation_rate, self.use_bias)

    def pre_activation(self, x):
        lay = self.layer
        if self.kind == "dense":
            s = tf.matmul(x, lay.kernel)
        else:
            s = tf.nn.conv2d(x, lay.kernel, strides=[1, *lay.strides, 1], padding=lay.padding.upper(),
                             dilations=[1, *lay.dilation_rate, 1])
        return s + lay.bias if self.use_bias else s


def _known(layer):
    if not layer.trainable:
        return False
    if isinstance(layer, tf.keras.layers.Conv2D):
        return (type(layer) is tf.keras.layers.Conv2D and layer.data_format == "channels_last"
                and getattr(layer, "groups", 1) == 1)
    return type(layer) is tf.keras.layers.Dense and len(layer.kernel.shape) == 2


class KfacOptimizer:
    """K-FAC preconditioning in front of a Keras optimizer, data-parallel over sdp.

    Mirrors the constructor of ``kfac.KfacOptimizer(learning_rate, damping, layer_collection,
    cov_ema_decay, momentum, norm_constraint)`` of TensorFlow's TF1 ``kfac`` library, with the model
    and its loss in place of the layer collection (Dense and Conv2D layers are registered by type).

    Args:
      model: a built ``keras.Sequential`` (``TypeError`` otherwise).
      loss_fn: ``loss_fn(labels, outputs)`` -> scalar mean over the batch (e.g.
        ``keras.losses.SparseCategoricalCrossentropy(from_logits=True)``).
      learning_rate: step size (float or a ``keras.optimizers.schedules.LearningRateSchedule``) of
        the default optimizer.  The norm constraint uses the optimizer's current learning rate.
      damping: Tikhonov damping λ added to the Fisher blocks, split π-wise between A and G.
      cov_ema_decay: decay of the factors' exponential moving average, in [0, 1).  The k-th factor
        update (k = 0, 1, ...) decays by min(cov_ema_decay, k / (k + 1)): a plain mean of the first
        batches (bias-corrected warm start), then the moving average.
      momentum: momentum of the default optimizer, ``keras.optimizers.SGD(learning_rate, momentum)``.
        0.5, not the guide's 0.9: with the norm constraint binding, 0.9 overshoots (Fashion-MNIST,
        global batch 1080: 38-47 steps to 0.85 test accuracy with 0.9, 12-15 with 0.5).
      norm_constraint: c, or None for none: the update is scaled by min(1, √(c / (lr² Σ ∇ᵀ F⁻¹∇)))
        (the KL clip of Ba et al. 2017; the ``kl_clip`` of kfac-pytorch).  Where it binds, the step's
        squared Fisher norm is c whatever the learning rate.
      inv_update_every: refresh the inverses every this many steps; during the first
        ``inv_update_every`` steps also at steps 0, 1, 2, 4, 8, ... (cheap early refreshes while the
        factors still change fast).
      cov_update_every: update the factors every this many steps, and at the early refreshes of the
        inverses (so these use new batches).
      optimizer: any Keras optimizer to apply the preconditioned gradients with instead of SGD.
      strategy: ``"chief"`` or ``"split"`` (see the module doc); one process needs no sdp.init().
      estimation_mode: how G is estimated, named like the ``kfac`` library's modes: ``"gradients"``
        backpropagates a loss on targets sampled from the model's predictive distribution (one per
        example; the model's outputs must be the logits of a categorical distribution), which
        estimates the true Fisher; ``"empirical"`` uses the gradients of ``loss_fn`` on the true
        labels (the empirical Fisher; no extra backward pass, any loss).

    ``step`` runs one synchronous training step and must be called by every rank.  ``timings``
    holds cumulative seconds spent in ``gradient`` (forward, backward, preconditioning and the
    optimizer's update), ``factor`` (the batch's factors and their moving averages), ``inverse``
    (this rank's own inversions) and ``communication`` (allreduce and broadcast, including waiting
    for other ranks); ``inverse_cpu`` is the CPU time of the calling thread in this rank's own
    inversions, which unlike ``inverse`` does not grow when more ranks than cores share the CPUs (it
    is all of their work with one TensorFlow intra-op thread, as with a rank per core).  Raises
    ``ValueError`` for a bad strategy or hyper-parameter, an unbuilt model, or a Dense layer on
    inputs of rank other than 2 (at the first step).
    """

    def __init__(self, model, loss_fn, learning_rate=0.1, damping=1e-3, cov_ema_decay=0.95, momentum=0.5,
                 norm_constraint=3e-3, inv_update_every=10, cov_update_every=1, optimizer=None,
                 strategy="chief", estimation_mode="empirical"):
        if not isinstance(model, tf.keras.Sequential):
            raise TypeError(f"KfacOptimizer needs a keras.Sequential model, got {type(model).__name__}")
        if not model.built:
            raise ValueError("KfacOptimizer needs a built model: start it with keras.Input(shape=...)")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if not 0.0 <= cov_ema_decay < 1.0:
            raise ValueError(f"cov_ema_decay must be in [0, 1), got {cov_ema_decay}")
        if damping <= 0:
            raise ValueError(f"damping must be > 0, got {damping}")
        if int(inv_update_every) < 1 or int(cov_update_every) < 1:
            raise ValueError(f"inv_update_every and cov_update_every must be >= 1, got {inv_update_every} "
                             f"and {cov_update_every}")
        if estimation_mode not in ESTIMATION_MODES:
            raise ValueError(f"estimation_mode must be one of {ESTIMATION_MODES}, got {estimation_mode!r}")
        if norm_constraint is not None and norm_constraint <= 0:
            raise ValueError(f"norm_constraint must be > 0 or None, got {norm_constraint}")
        self.model, self.loss_fn = model, loss_fn
        self.damping = float(damping)
        self.cov_ema_decay, self.norm_constraint = float(cov_ema_decay), norm_constraint
        self.inv_update_every, self.strategy = int(inv_update_every), strategy
        self.cov_update_every = int(cov_update_every)
        self.estimation_mode = estimation_mode
        self.optimizer = optimizer or tf.keras.optimizers.SGD(learning_rate, momentum=momentum)
        self.blocks = [_Block(i, lay) for i, lay in enumerate(model.layers) if _known(lay)]
        self.distributed = _api.is_initialized() and _api.size() > 1
        self.rank = _api.rank() if self.distributed else 0
        self.size = _api.size() if self.distributed else 1
        # inversion tasks: column blocks of the factors [A of block 0, G of block 0, A of block 1, ...]
        dims = [n for b in self.blocks for n in (b.n_in, b.n_out)]
        self.tasks, self.owners = inverse_tasks(dims, 1 if strategy == "chief" else self.size)
        self.iterations = 0
        self.cov_updates = 0  # factor updates so far (for the moving average's warm start)
        self.factors = None  # [(A, G)] moving averages: global (chief) or this rank's (split)
        self.inverses = None  # [(A⁻¹, G⁻¹)], the same on every rank
        self.timings = dict.fromkeys(TIMINGS + ("inverse_cpu",), 0.0)
        self._grads_fn = tf.function(self._grads_and_activations)
        self._factors_fn = tf.function(self._batch_factors)
        self._apply_fn = tf.function(self._precondition_and_apply)

    # -- the steps of one iteration ---------------------------------------------------------------

    def _grads_and_activations(self, x, y):
        """Forward layer by layer, backward; returns (loss, grads, the registered layers' inputs, their
        per-example output gradients)."""
        blocks = {b.index: b for b in self.blocks}
        inputs, pre = {}, {}
        with tf.GradientTape(persistent=self.estimation_mode == "gradients") as tape:
            h = x
            for i, lay in enumerate(self.model.layers):
                if i in blocks:
                    if blocks[i].kind == "dense" and h.shape.rank != 2:
                        raise ValueError(f"KfacOptimizer: Dense layer {lay.name!r} gets a rank-{h.shape.rank} "
                                         f"input {h.shape}; only (batch, features) inputs are supported")
                    inputs[i] = h
                    pre[i] = blocks[i].pre_activation(h)
                    h = lay.activation(pre[i])
                else:
                    h = lay(h, training=True)
            loss = self.loss_fn(y, h)
            if self.estimation_mode == "gradients":  # targets sampled from the model's distribution
                sampled = tf.stop_gradient(tf.random.categorical(h, 1)[:, 0])
                fisher_loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(sampled, h))
            else:
                fisher_loss = loss
        variables = self.model.trainable_variables
        idx = sorted(pre)
        if self.estimation_mode == "gradients":
            grads = tape.gradient(loss, variables)
            out_grads = tape.gradient(fisher_loss, [pre[i] for i in idx])
        else:
            grads, out_grads = tape.gradient(loss, [variables, [pre[i] for i in idx]])
        batch = tf.cast(tf.shape(x)[0], out_grads[0].dtype) if out_grads else 1.0
        # loss is a batch mean: B ∂loss/∂s_i is example i's own gradient ∂ℓ_i/∂s_i
        return loss, grads, [inputs[i] for i in idx], [g * batch for g in out_grads]

    def _batch_factors(self, inputs, output_grads):
        return [b.factors(a, g) for b, a, g in zip(self.blocks, inputs, output_grads)]

    def _precondition(self, grads, inverses):
        """(A + γ_A I)⁻¹ [dW; db] (G + γ_G I)⁻¹ for each registered layer, then the norm constraint."""
        pos = {id(v): k for k, v in enumerate(self.model.trainable_variables)}
        new = list(grads)
        for b, (a_inv, g_inv) in zip(self.blocks, inverses):
            ks = [pos[id(v)] for v in b.variables]
            m = tf.reshape(grads[ks[0]], [-1, b.n_out])
            if b.use_bias:
                m = tf.concat([m, grads[ks[1]][None, :]], axis=0)
            p = tf.matmul(tf.matmul(a_inv, m), g_inv)
            if b.use_bias:
                new[ks[1]] = p[-1]
                p = p[:-1]
            new[ks[0]] = tf.reshape(p, b.kernel_shape)
        if self.norm_constraint is not None:
            lr = tf.cast(self.optimizer.learning_rate, tf.float32)  # the current one, under a schedule
            sq = tf.add_n([tf.reduce_sum(g * p) for g, p in zip(grads, new)]) * lr ** 2
            coeff = tf.minimum(1.0, tf.sqrt(self.norm_constraint / tf.maximum(sq, 1e-30)))
            new = [coeff * p for p in new]
        return new

    def _precondition_and_apply(self, grads, inverses):
        self.optimizer.apply_gradients(zip(self._precondition(grads, inverses), self.model.trainable_variables))

    def preconditioned_gradients(self, grads):
        """``grads`` (one per ``model.trainable_variables``, same shapes) as ``step`` would apply
        them: preconditioned with the current inverses and scaled by the norm constraint.  Needs a
        previous ``step`` (``RuntimeError`` otherwise)."""
        if self.inverses is None:
            raise RuntimeError("preconditioned_gradients: no inverses yet; call step() first")
        return self._precondition(list(grads), self.inverses)

    def batch_gradients_and_factors(self, x, y):
        """This rank's ``(loss, grads, [(A, G)] per registered layer)`` for one batch, with no
        communication and no update."""
        loss, grads, inputs, output_grads = self._grads_fn(x, y)
        return loss, grads, self._factors_fn(inputs, output_grads)

    def _allreduce(self, tensors, name):
        return _coll.grouped_allreduce(tensors, op=ReduceOp.AVERAGE, name=name)

    def _ema(self, old, new):
        # warm start: the k-th update (k = 0, 1, ...) decays by min(cov_ema_decay, k / (k + 1)), so the
        # first updates are a plain mean of the batches so far (no bias towards the first batch)
        k = self.cov_updates
        self.cov_updates += 1
        d = min(self.cov_ema_decay, k / (k + 1))
        if old is None or d == 0:
            return [tuple(f) for f in new]
        return [(d * a0 + (1 - d) * a, d * g0 + (1 - d) * g) for (a0, g0), (a, g) in zip(old, new)]

    def _refresh_due(self, k):
        """Whether step ``k`` refreshes the inverses: every ``inv_update_every`` steps, and during the
        first ``inv_update_every`` steps also at steps 1, 2, 4, 8, ... (cheap early refreshes: the
        first factors come from very few batches)."""
        every = self.inv_update_every
        return k % every == 0 or (k < every and k & (k - 1) == 0)

    def step(self, x, y):
        """One training step on this rank's batch ``x`` (B, ...) with labels ``y`` (B, ...); every rank
        calls it with the same B.  Returns this rank's loss (float32 scalar tensor)."""
        t = self.timings
        refresh = self._refresh_due(self.iterations)
        update_cov = (self.iterations % self.cov_update_every == 0
                      or (refresh and self.iterations < self.inv_update_every))  # early refreshes: new data
        t0 = time.perf_counter()
        loss, grads, inputs, output_grads = self._grads_fn(x, y)
        t1 = time.perf_counter()
        t["gradient"] += t1 - t0
        flat_factors = [m for f in self._factors_fn(inputs, output_grads) for m in f] if update_cov else []
        t2 = time.perf_counter()
        t["factor"] += t2 - t1
        if self.distributed:
            # chief: grads and factors in one fused allreduce; split: factors stay local
            send = list(grads) + (flat_factors if self.strategy == "chief" else [])
            got = self._allreduce(send, "kfac.grads")
            grads, flat_factors = got[:len(grads)], (got[len(grads):] or flat_factors)
        t3 = time.perf_counter()
        t["communication"] += t3 - t2
        if update_cov:
            self.factors = self._ema(self.factors, list(zip(flat_factors[0::2], flat_factors[1::2])))
        t["factor"] += time.perf_counter() - t3
        if refresh:
            self._refresh_inverses()
        t4 = time.perf_counter()
        self._apply_fn(list(grads), self.inverses)
        t["gradient"] += time.perf_counter() - t4
        self.iterations += 1
        return loss

    def _refresh_inverses(self):
        t = self.timings
        factors = self.factors
        if self.distributed and self.strategy == "split":
            # the local moving averages, averaged: the moving average of the averaged factors
            t0 = time.perf_counter()
            flat = self._allreduce([m for f in factors for m in f], "kfac.factors")
            factors = list(zip(flat[0::2], flat[1::2]))
            t["communication"] += time.perf_counter() - t0
        t0, c0 = time.perf_counter(), time.thread_time()
        gammas = [gamma for a, g in factors for gamma in pi_damping(a, g, self.damping)]
        flat = [m for f in factors for m in f]
        mine, chol = {}, {}
        for k, (j, lo, hi) in enumerate(self.tasks):
            if self.owners[k] == self.rank:
                if j not in chol:
                    chol[j] = damped_cholesky(flat[j], gammas[j])
                mine[k] = inverse_columns(chol[j], lo, hi)
        t1 = time.perf_counter()
        if mine:
            t["inverse"] += t1 - t0
            t["inverse_cpu"] += time.thread_time() - c0
        if self.distributed:
            got = [_coll.broadcast(mine.get(k, tf.zeros((flat[j].shape[0], hi - lo))), self.owners[k],
                                   name=f"kfac.inv.{k}") for k, (j, lo, hi) in enumerate(self.tasks)]
        else:
            got = [mine[k] for k in range(len(self.tasks))]
        columns = [[] for _ in flat]
        for (j, _, _), block in zip(self.tasks, got):
            columns[j].append(block)
        inverses = [c[0] if len(c) == 1 else tf.concat(c, axis=1) for c in columns]
        t["communication"] += time.perf_counter() - t1
        self.inverses = list(zip(inverses[0::2], inverses[1::2]))

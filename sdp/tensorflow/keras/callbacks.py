"""Keras callbacks for data-parallel training.  Mirrors ``horovod.tensorflow.keras.callbacks``
(``BroadcastGlobalVariablesCallback``, ``MetricAverageCallback``, ``LearningRateScheduleCallback``,
``LearningRateWarmupCallback``, ``BestModelCheckpoint``).

They subclass the active Keras' ``Callback`` (``tf.keras``: Keras 3, or tf_keras with
``TF_USE_LEGACY_KERAS=1``).
"""
import warnings

import numpy as np
import tensorflow as tf

from sdp import api
from sdp.tensorflow.functions import broadcast_variables

_keras = tf.keras


def _check_device(device):
    if device:
        raise NotImplementedError(f"device={device!r} is not supported: sdp places collectives itself")


def _run(op):
    """Run a graph op in the Keras session (tf_keras in TF1 graph mode); no-op eagerly."""
    if op is not None and not tf.executing_eagerly():
        tf.compat.v1.keras.backend.get_session().run(op)


def _optimizer_variables(optimizer):
    if optimizer is None:
        return []
    v = optimizer.variables
    return list(v() if callable(v) else v)


def disable_jit(model) -> None:
    """If ``model`` was compiled with ``jit_compile=True``, switch XLA off and rebuild its train
    function: sdp's collectives are ``tf.numpy_function`` ops, which XLA cannot compile."""
    if getattr(model, "jit_compile", False) is True and not getattr(model, "run_eagerly", False):
        warnings.warn("sdp: model was compiled with jit_compile=True; sdp's collectives cannot run under XLA, "
                      "so the model is trained with jit_compile=False.", stacklevel=3)
        model.jit_compile = False
        if hasattr(model, "make_train_function"):
            model.train_function = None
            model.make_train_function(force=True)


class BroadcastGlobalVariablesCallback(_keras.callbacks.Callback):
    """Broadcast the model's weights and the optimizer's variables from ``root_rank``, so that
    every rank trains from the same state (random initialization or a restored checkpoint).

    When: at the start of training if the model's weights exist then; a model built lazily (a
    ``Sequential`` without an ``Input``, as in Horovod's Keras MNIST examples) has none until its
    first batch, so it is broadcast after the first batch instead, as Horovod does (Horovod always
    broadcasts after the first batch).  If the optimizer has no variables yet at train begin
    (tf_keras creates them on the first step), they are broadcast again after the first batch.

    ``root_rank`` (int): rank whose state everybody receives.  ``device``: not supported; a
    non-empty value raises ``NotImplementedError``.  ``local_variables``: a variable or a list of
    variables kept as they are on each rank (not broadcast), e.g. a local layer's
    ``trainable_weights`` with ``PartialDistributedOptimizer``.  Also turns ``jit_compile`` off
    (see ``disable_jit``).
    Mirrors ``horovod.tensorflow.keras.callbacks.BroadcastGlobalVariablesCallback``."""

    def __init__(self, root_rank, device="", local_variables=None):
        super().__init__()
        _check_device(device)
        self.root_rank = int(root_rank)
        self.device = device
        self.broadcast_done = False
        if local_variables is None:
            local_variables = []
        elif not isinstance(local_variables, (list, tuple, set)):
            local_variables = [local_variables]
        self.local_variables = list(local_variables)
        self._local_refs = {_var_ref(v) for v in self.local_variables}

    def _broadcast(self):
        variables = _model_weights(self.model) + _optimizer_variables(getattr(self.model, "optimizer", None))
        variables = [v for v in variables if _var_ref(v) not in self._local_refs]
        _run(broadcast_variables(variables, root_rank=self.root_rank))

    def on_train_begin(self, logs=None):
        disable_jit(self.model)
        if self.broadcast_done or not _model_weights(self.model):
            return  # a model built lazily: its weights exist after the first batch
        self._broadcast()
        self.broadcast_done = bool(_optimizer_variables(getattr(self.model, "optimizer", None)))

    def on_train_batch_end(self, batch, logs=None):
        if self.broadcast_done:
            return
        self._broadcast()
        self.broadcast_done = True


def _var_ref(v):
    return v.ref() if hasattr(v, "ref") else id(v)


def _model_weights(model) -> list:
    """``model.weights``, or ``[]`` while a lazily built model has none (tf_keras raises
    ``ValueError`` for an unbuilt ``Sequential``; Keras 3 returns an empty list)."""
    try:
        return list(model.weights)
    except ValueError:
        return []


class MetricAverageCallback(_keras.callbacks.Callback):
    """At the end of every epoch, replace each metric in ``logs`` by its average over all ranks
    (in place, so callbacks after this one, and the History, see the averages).  Put it before
    ``ReduceLROnPlateau``, ``TensorBoard``, ``ModelCheckpoint`` and other metric-based callbacks.

    Every rank must have the same metric names.  ``device``: not supported (``NotImplementedError``
    if non-empty).  Like every sdp callback, it turns ``jit_compile`` off (see ``disable_jit``).
    Mirrors ``horovod.tensorflow.keras.callbacks.MetricAverageCallback``."""

    def __init__(self, device=""):
        super().__init__()
        _check_device(device)
        self.device = device

    def _average_metrics_in_place(self, logs):
        if not logs:
            return
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and _is_number(v))
        if not names:
            return
        values = [np.asarray(float(np.asarray(logs[k])), dtype=np.float64) for k in names]
        reduced = api.grouped_allreduce(values, name="MetricAverageCallback." + ",".join(names))
        for k, v in zip(names, reduced):
            logs[k] = float(v)

    def on_train_begin(self, logs=None):
        disable_jit(self.model)

    def on_epoch_end(self, epoch, logs=None):
        self._average_metrics_in_place(logs)


def _is_number(v) -> bool:
    try:
        float(np.asarray(v))
        return True
    except (TypeError, ValueError):
        return False


def _get_value(v) -> float:
    if hasattr(v, "numpy"):
        return float(v.numpy())
    if hasattr(v, "value") and not isinstance(v, (float, int, np.ndarray, np.generic)):
        val = v.value
        val = val() if callable(val) else val
        if hasattr(val, "numpy"):
            return float(val.numpy())
    if tf.is_tensor(v) or isinstance(v, tf.Variable):
        return float(tf.compat.v1.keras.backend.get_session().run(v))
    return float(v)


def _lr_variable_or_value(optimizer):
    return optimizer.learning_rate if hasattr(optimizer, "learning_rate") else optimizer.lr


def get_learning_rate(optimizer) -> float:
    """The optimizer's current learning rate as a float (Keras 3 or tf_keras)."""
    return _get_value(_lr_variable_or_value(optimizer))


def set_learning_rate(optimizer, value: float) -> None:
    """Set the optimizer's learning rate (a variable); raises ``TypeError`` if the optimizer was
    created with a ``LearningRateSchedule``, whose rate cannot be set."""
    current = getattr(optimizer, "_learning_rate", None)
    schedules = tuple(c for c in (getattr(getattr(_keras.optimizers, "schedules", None), "LearningRateSchedule",
                                          None),) if c is not None)
    if schedules and isinstance(current, schedules):
        raise TypeError("the optimizer's learning rate is a LearningRateSchedule and cannot be set by a "
                        "learning-rate callback; create the optimizer with a float learning_rate")
    if tf.executing_eagerly():
        optimizer.learning_rate = float(value)
    else:
        tf.compat.v1.keras.backend.set_value(_lr_variable_or_value(optimizer), float(value))


def _momentum_variable(optimizer):
    """The optimizer's momentum if it is a variable (tf_keras legacy), else None: Keras 3 keeps
    momentum as a Python float compiled into the train step, which cannot be changed per batch."""
    m = getattr(optimizer, "momentum", None)
    if m is None or isinstance(m, (float, int)):
        return None
    return m


class LearningRateScheduleCallback(_keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` up to (not
    including) ``end_epoch``.

    ``multiplier``: a constant (then the rate is ``initial_lr * multiplier ** epoch``) or a function
    of the epoch.  ``staircase=True`` adjusts at the start of each epoch with an integer epoch;
    ``False`` adjusts every batch with ``epoch + batch / steps_per_epoch`` (``steps_per_epoch`` is
    detected from ``fit``; ``ValueError`` if it cannot be).  ``momentum_correction`` scales a
    momentum held in a variable (tf_keras) by ``new_lr / old_lr`` for the batch; Keras 3 momentum is
    a constant of the compiled step and is left alone.  ``initial_lr=None`` raises ``ValueError``.
    Writes the current rate to ``logs["lr"]`` at epoch end.
    Mirrors ``horovod.tensorflow.keras.callbacks.LearningRateScheduleCallback``."""

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = float(initial_lr)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.restore_momentum = None
        self.current_epoch = None
        if not callable(multiplier):
            factor = float(multiplier)
            self.multiplier = lambda epoch: factor ** epoch
        else:
            self.multiplier = multiplier

    def _autodetect_steps_per_epoch(self):
        params = self.params or {}
        if params.get("steps"):
            return params["steps"]
        if params.get("samples") and params.get("batch_size"):
            return params["samples"] // params["batch_size"]
        raise ValueError("Could not autodetect the number of steps per epoch. Please specify the steps_per_epoch "
                         f"parameter to the {type(self).__name__}().")

    def _adjust_learning_rate(self, epoch):
        opt = self.model.optimizer
        old_lr = get_learning_rate(opt)
        new_lr = self.initial_lr * self.multiplier(epoch)
        set_learning_rate(opt, new_lr)
        momentum = _momentum_variable(opt)
        if momentum is not None and self.momentum_correction and old_lr > 0:
            self.restore_momentum = _get_value(momentum)
            _set_variable(momentum, self.restore_momentum * new_lr / old_lr)

    def _restore_momentum_if_needed(self):
        if self.restore_momentum is not None:
            _set_variable(_momentum_variable(self.model.optimizer), self.restore_momentum)
            self.restore_momentum = None

    def on_train_begin(self, logs=None):
        disable_jit(self.model)
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.current_epoch < self.start_epoch or (self.end_epoch is not None
                                                     and self.current_epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_train_batch_end(self, batch, logs=None):
        self._restore_momentum_if_needed()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = get_learning_rate(self.model.optimizer)


def _set_variable(var, value):
    if tf.executing_eagerly():
        var.assign(value)
    else:
        tf.compat.v1.keras.backend.set_value(var, value)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual learning-rate warmup: from ``initial_lr / size()`` to ``initial_lr`` over
    ``warmup_epochs`` epochs, adjusted every batch:
    ``lr(epoch) = initial_lr / size * (epoch * (size - 1) / warmup_epochs + 1)`` with
    ``epoch = full_epochs + batch / steps_per_epoch`` (Goyal et al., "Accurate, Large Minibatch
    SGD", 2017).  ``verbose=1`` prints a line on rank 0 when the warmup ends.
    Mirrors ``horovod.tensorflow.keras.callbacks.LearningRateWarmupCallback``."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            # Shift by one batch so that each epoch ends on a round value.
            epoch += 1.0 / self.steps_per_epoch
            n = api.size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and api.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{get_learning_rate(self.model.optimizer):g}.")


class BestModelCheckpoint(_keras.callbacks.ModelCheckpoint):
    """A ``ModelCheckpoint`` that keeps only the best model (``save_best_only=True``).

    As in Horovod, the path is not a constructor argument of the original; sdp accepts it as the
    keyword ``filepath`` or as the attribute ``callback.filepath`` set before training (``ValueError``
    at the start of training if it is still unset).  Keras 3 needs ``.keras`` (or
    ``.weights.h5`` with ``save_weights_only=True``).  Add it on rank 0 only, so that ranks do not
    overwrite each other's files.
    Mirrors ``horovod.tensorflow.keras.callbacks.BestModelCheckpoint``."""

    def __init__(self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto", save_freq="epoch",
                 *, filepath=None):
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(filepath=placeholder, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        self.filepath = filepath if filepath is None else str(filepath)

    def on_train_begin(self, logs=None):
        disable_jit(self.model)
        if self.filepath is None:
            raise ValueError("BestModelCheckpoint has no filepath: pass filepath=... or set callback.filepath "
                             "before training")
        parent = getattr(super(), "on_train_begin", None)
        if parent is not None:
            parent(logs)

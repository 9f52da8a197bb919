"""Horovod Elastic for Keras (``horovod.tensorflow.keras.elastic`` / ``horovod.keras.elastic``;
the same module under ``sdprun --compat horovod``).

``run`` and ``KerasState`` (= ``sdp.tensorflow.elastic.TensorFlowKerasState``) as in
``sdp.tensorflow.elastic``, plus Horovod's Keras callbacks for ``model.fit``:

* ``CommitStateCallback`` (``state``, ``batches_per_commit=1``): ``state.commit()`` after
  every ``batches_per_commit`` batches and at the end of each epoch;
* ``UpdateBatchStateCallback``: keeps ``state.batch`` (index of the last finished batch of
  the epoch; 0 after an epoch) and, when ``fit`` has ``steps_per_epoch``, shortens the epoch
  resumed after a reset by the batches already done;
* ``UpdateEpochStateCallback``: keeps ``state.epoch``, the number of finished epochs over
  all ``fit`` calls (``fit(epochs=epochs - state.epoch)`` resumes where the job was).
"""
import tensorflow as tf

from sdp.tensorflow.elastic import (HorovodInternalError, HostsUpdatedInterrupt, ObjectState,  # noqa: F401
                                    State, TensorFlowKerasState, run)

KerasState = TensorFlowKerasState
"""``horovod.tensorflow.keras.elastic.KerasState``: ``TensorFlowKerasState`` under Keras' name."""

__all__ = ["run", "KerasState", "TensorFlowKerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback"]


class CommitStateCallback(tf.keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches (and at each epoch's end).
    Mirrors ``horovod.tensorflow.keras.elastic.CommitStateCallback``."""

    def __init__(self, state, batches_per_commit: int = 1):
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be at least 1, got {batches_per_commit}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit  # the same count on every rank after a sync

    def on_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(tf.keras.callbacks.Callback):
    """Keep ``state.batch`` up to date.  Mirrors
    ``horovod.tensorflow.keras.elastic.UpdateBatchStateCallback``."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.steps_per_epoch = None

    def on_train_begin(self, logs=None):
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params.get("steps")
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(tf.keras.callbacks.Callback):
    """Keep ``state.epoch`` up to date.  Mirrors
    ``horovod.tensorflow.keras.elastic.UpdateEpochStateCallback``."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch  # Keras counts from 0 in every fit() call

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1

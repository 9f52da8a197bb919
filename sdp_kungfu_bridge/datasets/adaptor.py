"""``kungfu.datasets.adaptor`` on sdp: KungFu's ``tf.data`` adaptor for TF1 sessions, which shards a
dataset over workers and keeps the position in it in variables, so that a job can rewind it or
change its shape (more workers, another batch size) and go on from the same sample.

Under ``sdprun --compat kungfu`` (or after ``sdp.compat.install("kungfu")``) this module *is*
``kungfu.datasets.adaptor``.  KungFu ships it at that path (not under ``kungfu.tensorflow.v1``);
its TF1 examples import it beside ``kungfu.tensorflow.v1.helpers``.  Build it in a graph
(``tf.compat.v1``: a ``tf.Graph`` or ``disable_eager_execution``) and run its ops in a ``Session``.

``BaseDatasetAdaptor(batch_size=10, shard_count=1, shard_id=0)``
    Four ``int64`` variables: the batch size (samples per worker and step), the shard count (the
    workers), this worker's shard id and the offset (samples of the input already consumed by the
    whole job, starting at 0).  ``adaptor(ds)`` returns ``(init_op, next_batch)`` of an
    initializable iterator over ``ds.skip(offset).batch(batch_size).shard(shard_count,
    shard_id)``: from the offset on, batches of ``batch_size``, of which this worker takes every
    ``shard_count``-th starting at its id.  The variables are read when ``init_op`` runs, so run it
    again after changing them.
    ``create_update_offset()``: op adding ``batch_size * shard_count`` to the offset (run it once
    per step: the samples the job consumed in that step).  ``create_rewind()``: op setting the
    offset back to 0 (at the end of the input).  ``create_update_topology()``: raises
    ``RuntimeError('Not implemented')``; subclasses return the op changing the shape.
    ``debug(sess)``: prints ``offset=O, np=N, rank=R, batch size=B``.
    Raises ``ValueError`` (naming the values) for a batch size or shard count below 1 or a shard id
    outside ``[0, shard_count)`` given as Python integers (tensors are used as given).

``ExampleDatasetAdaptor``
    KungFu's example subclass: its ``create_update_topology()`` adds one shard (worker), adds 2 to
    the batch size and moves the shard id to ``(shard_id + 1) % new shard count``.

The variables belong to each worker (nothing is communicated): every worker builds the same
adaptor with its own ``shard_id`` (``current_rank()``) and ``shard_count``
(``current_cluster_size()``) and runs the same updates, as in KungFu.  They are global variables
(``global_variables_initializer`` initialises them, as KungFu's examples expect), also in the
collection ``PER_WORKER_VARIABLES`` of ``sdp_kungfu_bridge.tensorflow.initializer``, which
``BroadcastGlobalVariablesOp`` leaves out (KungFu's broadcast would give every worker rank 0's
shard id: all would read the same batches).
"""
import numbers

import tensorflow as tf

from sdp_kungfu_bridge.tensorflow.initializer import PER_WORKER_VARIABLES

__all__ = ['BaseDatasetAdaptor', 'ExampleDatasetAdaptor']

_v1 = tf.compat.v1


def _check(batch_size, shard_count, shard_id):
    ints = [v for v in (batch_size, shard_count, shard_id) if isinstance(v, numbers.Integral)]
    if len(ints) != 3:
        return
    if batch_size < 1:
        raise ValueError(f"BaseDatasetAdaptor: batch_size must be >= 1, got {batch_size}")
    if shard_count < 1:
        raise ValueError(f"BaseDatasetAdaptor: shard_count must be >= 1, got {shard_count}")
    if not 0 <= shard_id < shard_count:
        raise ValueError(f"BaseDatasetAdaptor: shard_id must be in [0, {shard_count}), got {shard_id}")


def _int64_variable(value, name):
    return _v1.Variable(tf.cast(value, tf.int64), trainable=False, name=name,
                        collections=[_v1.GraphKeys.GLOBAL_VARIABLES, PER_WORKER_VARIABLES])


class BaseDatasetAdaptor(object):
    """See the module docstring."""

    def __init__(self, batch_size=10, shard_count=1, shard_id=0):
        _check(batch_size, shard_count, shard_id)
        self._batch_size = _int64_variable(batch_size, "kungfu_dataset_batch_size")
        self._shard_count = _int64_variable(shard_count, "kungfu_dataset_shard_count")
        self._shard_id = _int64_variable(shard_id, "kungfu_dataset_shard_id")
        self._offset = _int64_variable(0, "kungfu_dataset_offset")

    def create_update_offset(self):
        return _v1.assign_add(self._offset, self._batch_size * self._shard_count)

    def create_rewind(self):
        return _v1.assign(self._offset, tf.constant(0, tf.int64))

    def create_update_topology(self):
        raise RuntimeError('Not implemented')  # a subclass changes the shape (see ExampleDatasetAdaptor)

    def debug(self, sess):
        off, n, rank, bs = sess.run([self._offset, self._shard_count, self._shard_id, self._batch_size])
        print('offset=%d, np=%d, rank=%d, batch size=%d' % (off, n, rank, bs), flush=True)

    def __call__(self, ds):
        ds = ds.skip(self._offset).batch(self._batch_size).shard(self._shard_count, self._shard_id)
        it = _v1.data.make_initializable_iterator(ds)
        return it.initializer, it.get_next()


class ExampleDatasetAdaptor(BaseDatasetAdaptor):
    """KungFu's example: ``create_update_topology()`` adds a worker and 2 to the batch size."""

    def create_update_topology(self):
        grow = _v1.assign_add(self._shard_count, tf.constant(1, tf.int64))
        bigger = _v1.assign(self._batch_size, self._batch_size + 2)
        with tf.control_dependencies([grow]):
            return tf.group([_v1.assign(self._shard_id, tf.math.floormod(self._shard_id + 1, self._shard_count)),
                             bigger])

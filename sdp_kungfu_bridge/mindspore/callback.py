"""Elastic MindSpore callbacks on sdp: mirrors the KungFu fork's ``mindspore.train.callback._kungfu``.

Under ``sdprun --compat kungfu`` (or after ``sdp_kungfu_bridge.mindspore.install``) this module
*is* ``mindspore.train.callback._kungfu``.

``sync_net_parameters(network)``
    Broadcast every parameter of ``network`` from rank 0 and write it into the parameter *in
    place*.  MindSpore 2.10 PYNATIVE workaround: the guide's ``param.set_data(new_tensor)`` after
    the optimizer compiled leaves the optimizer updating the old storage, so the parameter
    never moves again (silently).  ``ops.assign`` keeps the storage, in both modes.

``KungFuElasticCallback(schedule, max_step=None, local_batch_size=None)``
    The guide's elastic callback: a global step counter (the fork's float32 tensor), advanced
    at every ``step_begin``; the first step and every step after a resize synchronise the step
    (broadcast from rank 0, printed as ``sync step OLD -> NEW``) and the parameters.  At
    ``step_end`` of a step in ``schedule`` (``{step: new size}``) it calls ``KungFuResize``: a
    worker that was removed (``detached``) asks ``Model.train`` to stop.  ``max_step`` (not in the
    fork): stop every worker when the global step reaches it, so workers that joined later (and
    whose epoch started later) end at the same step as the others.  ``global_step`` /
    ``steps_run`` tell the step and how many steps this worker ran.

    The data position (not in the fork; KungFu's TensorFlow ``ElasticHook`` does the same with
    its trained-samples offset): with ``local_batch_size`` (samples per worker and step), the
    callback counts ``data_position``, the samples the whole cluster has trained on (each step
    adds ``local_batch_size * cluster size``), and a resize that changed the cluster stops
    ``Model.train`` (``resized`` true) so the script can re-shard.  The script builds each
    dataset from ``sync_data_position()`` (a collective, every worker calls it before building:
    the largest position of any worker, as KungFu's ``all_reduce(..., op='max')``; a joiner has
    0, printed as ``sync data position OLD -> NEW``), its rank and the cluster size, then
    ``Model.train`` again, until ``global_step`` reaches ``max_step`` or it is ``detached``.
    So a joiner continues at the global sample position of the others, as it does at their
    step.  See ``examples/mindspore_lenet_elastic.py``.

``LogStepHook()``
    Prints the epoch and step at their begin and end (the fork's debugging callback).
"""
import mindspore as ms
from mindspore import ops

from sdp_kungfu_bridge import _cluster
from sdp_kungfu_bridge.mindspore import ops as kfops

__all__ = ['KungFuElasticCallback', 'LogStepHook', 'sync_net_parameters']


def _copy_into(param, value) -> None:
    """``param[...] = value`` keeping the parameter's storage (see the module docstring)."""
    if tuple(param.shape) == tuple(value.shape) and param.dtype == value.dtype:
        ops.assign(param, value)
    else:  # a different shape/dtype cannot be copied in place
        param.set_data(value)


def sync_net_parameters(network: ms.nn.Cell) -> None:
    """Make every parameter of ``network`` rank 0's (a collective: every worker calls it)."""
    broadcast = kfops.KungFuBroadcast()
    network.init_parameters_data()
    for _name, param in network.parameters_and_names():
        x = broadcast(ms.Tensor(param.asnumpy()))
        _copy_into(param, x)


class KungFuElasticCallback(ms.train.callback.Callback):
    """See the module docstring.  ``schedule``: ``{global step: new cluster size}``."""

    def __init__(self, schedule, max_step=None, local_batch_size=None):
        super().__init__()
        self.schedule = {int(k): int(v) for k, v in dict(schedule or {}).items()}
        self.max_step = None if max_step is None else int(max_step)
        if local_batch_size is not None and int(local_batch_size) < 1:
            raise ValueError(f"KungFuElasticCallback: local_batch_size must be >= 1, got {local_batch_size!r}")
        self.local_batch_size = None if local_batch_size is None else int(local_batch_size)
        self.need_sync = True
        self.broadcast = kfops.KungFuBroadcast()
        self.resize = kfops.KungFuResize()
        self._kungfu_global_step = ms.Tensor(0.0, dtype=ms.float32)
        self.steps_run = 0
        self.detached = False
        self.resized = False
        self.data_position = 0

    def sync_data_position(self) -> int:
        """Make ``data_position`` the largest of every worker's (a collective) and return it."""
        old = self.data_position
        synced = kfops.KungFuAllReduce('max')(ms.Tensor(old, dtype=ms.int64))
        self.data_position = int(synced.asnumpy())
        self.resized = False
        print('sync data position %d -> %d' % (old, self.data_position), flush=True)
        return self.data_position

    @property
    def finished(self) -> bool:
        """``detached``, or ``global_step`` reached ``max_step``."""
        return self.detached or (self.max_step is not None and self.global_step >= self.max_step)

    @property
    def global_step(self) -> int:
        return int(self._kungfu_global_step.asnumpy())

    def _advance_step(self):
        self._kungfu_global_step = ms.Tensor(self.global_step + 1.0, dtype=ms.float32)

    def _sync_step(self):
        old_step = self.global_step
        self._kungfu_global_step = self.broadcast(self._kungfu_global_step)
        print('sync step %d -> %d' % (old_step, self.global_step), flush=True)

    def step_begin(self, run_context):
        self._advance_step()
        if self.need_sync:
            self._sync_step()
            sync_net_parameters(run_context.original_args().train_network)
            self.need_sync = False
        self.steps_run += 1

    def step_end(self, run_context):
        step = self.global_step
        if self.local_batch_size is not None:
            self.data_position += self.local_batch_size * _cluster.size()
        if step in self.schedule:
            new_size = self.schedule[step]
            print('calling resize with %d at step %d' % (new_size, step), flush=True)
            changed, detached = self.resize(ms.Tensor(new_size, dtype=ms.uint32))
            if bool(changed):
                self.need_sync = True
            if bool(detached):
                self.detached = True
                print('detached, requesting stop', flush=True)
                run_context.request_stop()
                return
            if bool(changed) and self.local_batch_size is not None:
                self.resized = True  # re-shard: the script syncs the data position, trains on
                run_context.request_stop()
                return
        if self.max_step is not None and step >= self.max_step:
            run_context.request_stop()

    def end(self, run_context):
        print('stopped', flush=True)


class LogStepHook(ms.train.callback.Callback):
    """Prints ``epoch begin/end N`` and ``step begin/end N``."""

    def __init__(self):
        super().__init__()
        self._epoch = 0
        self._step = 0

    def begin(self, run_context):
        print('LogStepHook::BEGIN', flush=True)

    def epoch_begin(self, run_context):
        print('epoch begin %d' % self._epoch, flush=True)

    def epoch_end(self, run_context):
        print('epoch end %d' % self._epoch, flush=True)
        self._epoch += 1

    def step_begin(self, run_context):
        print('step begin %d' % self._step, flush=True)

    def step_end(self, run_context):
        print('step end %d' % self._step, flush=True)
        self._step += 1

    def end(self, run_context):
        print('LogStepHook::END after %d steps' % self._step, flush=True)

"""Horovod's ``DistributedOptimizer`` for PyTorch on sdp (``horovod.torch.optimizer`` under
``sdprun --compat horovod``).

``hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())`` returns an
optimizer of the wrapped optimizer's class (a subclass made on the fly, sharing its
``param_groups``) that averages gradients over the ranks:

- Each parameter gets a hook (``Tensor.register_post_accumulate_grad_hook``) that runs as soon as
  its gradient is accumulated during ``backward()``; after ``backward_passes_per_step`` such
  passes (gradients accumulate locally in ``.grad`` meanwhile) it starts the gradient's in-place
  allreduce asynchronously (name: its ``named_parameters`` name), so communication overlaps the
  rest of the backward pass.  ``step()`` waits for all of them (``synchronize``) and then runs
  the wrapped optimizer's ``step``; parameters whose hook did not fire are allreduced there.
- ``groups``: an int (the parameters, in rank 0's order, split into that many groups) or a list
  of lists of parameters (the rest one group each): a group's gradients go as one grouped
  allreduce once all of them are ready.
- ``op`` (Average, Sum, ...); ``gradient_predivide_factor`` (Average only: gradients are scaled
  by ``1/f`` before the sum and by ``f/size`` after); ``compression`` (``Compression.fp16``
  casts gradients, only where they cross a network: ``sdp.torch.compression.gradient_compression``);
  sparse gradients (``nn.Embedding(sparse=True)``) go as allgathers of indices and values, or
  dense with ``sparse_as_dense=True``; ``process_set``.
- ``synchronize()`` (e.g. before clipping) then ``with optimizer.skip_synchronize(): step()``;
  ``zero_grad()`` while allreduces are in flight raises ``AssertionError``, as does a gradient
  computed more than ``backward_passes_per_step`` times before ``step()``.

``ValueError`` (Horovod's messages): ``named_parameters`` not ``(name, tensor)`` tuples, duplicate
names, parameters left unnamed, bad ``groups``, ``backward_passes_per_step <= 0``,
``gradient_predivide_factor`` with another op than Average.

``op=Adasum`` on more than one rank is Horovod's Adasum optimizer: each parameter's hook runs the
wrapped optimizer's step for that parameter and starts an Adasum allreduce (sdp's engine,
``sdp.engine.adasum``: a power-of-two number of ranks, float tensors) of the change it made;
``step()`` applies the combined changes.  ``synchronize()`` does nothing there and
``skip_synchronize()`` raises ``AssertionError``, as in Horovod.
"""
import os
import warnings
from contextlib import contextmanager

import torch

from sdp import api
from sdp import elastic as _elastic
from sdp.common.reduce_ops import ReduceOp
from sdp.common.util import split_list
from sdp.process_sets import global_process_set
from sdp.torch import mpi_ops
from sdp.torch.compression import Compression, gradient_compression


class _DistributedOptimizer(torch.optim.Optimizer):
    """The methods a ``DistributedOptimizer`` adds to the wrapped optimizer's class."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1, op=ReduceOp.AVERAGE,
                 gradient_predivide_factor=1.0, groups=None, sparse_as_dense=False,
                 process_set=global_process_set):
        super().__init__(params)
        self._compression = gradient_compression(compression)
        named_parameters = _named(self.param_groups, named_parameters)
        self._parameter_names = {v: k for k, v in sorted(named_parameters, key=lambda kv: kv[0])}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {v: backward_passes_per_step for _, v in named_parameters}
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._handles = {}
        self._hook_handles = []
        self._requires_update = set()
        self._synchronized = False
        self._should_synchronize = True
        if groups is not None:
            if not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
                raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
            if isinstance(groups, list):
                seen = set()
                for group in groups:
                    for p in group:
                        if not isinstance(p, torch.Tensor):
                            raise ValueError("groups must consist of torch.Tensor.")
                        if id(p) in seen:
                            raise ValueError("A parameter can only appear once in groups.")
                        seen.add(id(p))
        self._groups = groups
        self._p_to_group = {}
        self._group_counts = {}
        if self.process_set.included() and (mpi_ops.size() > 1 or _elastic.control_url() is not None
                                            or os.environ.get("HOROVOD_ELASTIC") == "1"):
            self._register_hooks()

    def load_state_dict(self, *args, **kwargs):
        self._handles = {}
        self._synchronized = False
        self._should_synchronize = True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        super().load_state_dict(*args, **kwargs)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change ``backward_passes_per_step`` (and restart the count of every parameter)."""
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def _register_hooks(self):
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        if self._groups is not None:
            names = api.broadcast_object([self._parameter_names.get(p) for p in params], root_rank=0,
                                         process_set=self.process_set)  # (rank 0's order on every rank)
            params = sorted(params, key=lambda p: names.index(self._parameter_names.get(p)))
            if isinstance(self._groups, list):
                ids = {id(p) for p in params}
                p_groups = [[p for p in group if id(p) in ids] for group in self._groups]
                grouped = {id(p) for group in p_groups for p in group}
                p_groups += [[p] for p in params if id(p) not in grouped]
            else:
                p_groups = split_list(params, self._groups)
            for group in (tuple(g) for g in p_groups if g):
                for p in group:
                    self._p_to_group[p] = group
                self._group_counts[group] = 0
        for p in params:
            self._requires_update.add(p)
            self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def _scales(self):
        if self.op == ReduceOp.AVERAGE:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _allreduce_grad_async(self, p):
        if p.grad is None:
            p.grad = p.data.new(p.size()).zero_()
        name = self._parameter_names.get(p)
        tensor = p.grad
        if tensor.is_sparse:
            if not self.sparse_as_dense:
                return mpi_ops.sparse_allreduce_async(tensor, name, self.op, self.process_set), None
            tensor = tensor.to_dense()
        compressed, ctx = self._compression.compress(tensor)
        pre, post = self._scales()
        handle = mpi_ops.allreduce_async_(compressed, name=name, op=self.op, prescale_factor=pre,
                                          postscale_factor=post, process_set=self.process_set)
        return handle, ctx

    def _grouped_allreduce_grad_async(self, group):
        compressed, ctxs = zip(*[self._compression.compress(p.grad) for p in group])
        pre, post = self._scales()
        handle = mpi_ops.grouped_allreduce_async_(list(compressed), name=self._parameter_names.get(group[0]),
                                                  op=self.op, prescale_factor=pre, postscale_factor=post,
                                                  process_set=self.process_set)
        return handle, ctxs

    def _make_hook(self, p):
        def hook(*_):
            if p in self._handles and self._handles[p][0] is not None and self._allreduce_delay[p] <= 0:
                raise AssertionError("Gradients were computed more than backward_passes_per_step times before call "
                                     "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
            assert not p.grad.requires_grad
            assert self._allreduce_delay[p] > 0
            handle, ctx = None, None
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] == 0:
                if self._groups is not None:
                    group = self._p_to_group[p]
                    self._group_counts[group] += 1
                    if self._group_counts[group] == len(group):
                        self._handles[group] = self._grouped_allreduce_grad_async(group)
                        for gp in group:
                            self._handles.pop(gp, None)
                        self._group_counts[group] = 0
                        return
                else:
                    handle, ctx = self._allreduce_grad_async(p)
            self._handles[p] = (handle, ctx)
        return hook

    def synchronize(self):
        """Wait for every gradient's allreduce (starting those whose hook did not run) and put the
        results in ``.grad``.  Mirrors ``horovod.torch.DistributedOptimizer.synchronize``."""
        if not self.process_set.included():
            self._synchronized = True
            return
        done = set()
        for key in self._handles:
            done.update(key) if isinstance(key, tuple) else done.add(key)
        for p in self._requires_update - done:
            self._handles[p] = self._allreduce_grad_async(p)
        for p, (handle, _) in list(self._handles.items()):
            if handle is None:
                self._handles[p] = self._allreduce_grad_async(p)
        for key, (handle, ctx) in self._handles.items():
            if isinstance(key, tuple):
                outputs = mpi_ops.synchronize(handle)
                for gp, out, gctx in zip(key, outputs, ctx):
                    self._allreduce_delay[gp] = self.backward_passes_per_step
                    _set_grad(gp, self._compression.decompress(out, gctx))
                self._group_counts[key] = 0
                continue
            out = handle() if callable(handle) else mpi_ops.synchronize(handle)
            self._allreduce_delay[key] = self.backward_passes_per_step
            if self._groups is not None:
                self._group_counts[self._p_to_group[key]] = 0
            if key.grad.is_sparse:
                aggregated = self._compression.decompress(out, ctx)
                key.grad.zero_().add_(aggregated if aggregated.is_sparse else aggregated.to_sparse())
            else:
                _set_grad(key, self._compression.decompress(out, ctx))
        self._handles.clear()
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """A context in which ``step()`` does not synchronize (after an explicit
        ``synchronize``).  Mirrors Horovod's."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                              "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                              "your code.")
            self.synchronize()
        self._synchronized = False
        return super().step(closure)

    def zero_grad(self, *args, **kwargs):
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                                 "or optimizer.synchronize(). This is prohibited as it can cause a race condition.")
        return super().zero_grad(*args, **kwargs)


class _DistributedAdasumOptimizer(torch.optim.Optimizer):
    """Horovod's Adasum optimizer: each parameter's gradient hook runs the wrapped optimizer's
    step for that parameter alone and starts an Adasum allreduce of the change it made (the
    model delta); ``step()`` waits for them and applies the combined deltas to the parameters as
    they were before (Horovod's ``_DistributedAdasumOptimizer``)."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1):
        super().__init__(params)
        self._compression = compression
        named_parameters = _named(self.param_groups, named_parameters)
        self._parameter_names = {v: k for k, v in sorted(named_parameters, key=lambda kv: kv[0])}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {v: backward_passes_per_step for _, v in named_parameters}
        self._handles = {}
        self._hook_handles = []
        self._requires_update = set()
        self._starting_models = {p: torch.zeros_like(p, requires_grad=False) for _, p in named_parameters}
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = p.data.new(p.size()).zero_()
                    self._requires_update.add(p)
                    self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    set_backward_passes_per_step = _DistributedOptimizer.set_backward_passes_per_step

    def _allreduce_grad_async(self, p):
        start = self._starting_models[p]
        stashed = [group["params"] for group in self.param_groups]
        for group in self.param_groups:  # (the wrapped optimizer steps this parameter alone)
            group["params"] = [p] if any(p is v for v in group["params"]) else []
        try:
            start.data.copy_(p)
            super().step()
            p.data.sub_(start)
        finally:
            for group, params in zip(self.param_groups, stashed):
                group["params"] = params
        compressed, ctx = self._compression.compress(p.data)
        return mpi_ops.allreduce_async_(compressed, name=self._parameter_names.get(p), op=ReduceOp.ADASUM), ctx

    def _make_hook(self, p):
        def hook(*_):
            if p in self._handles and self._handles[p][0] is not None and self._allreduce_delay[p] <= 0:
                raise AssertionError("Gradients were computed more than backward_passes_per_step times before call "
                                     "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
            handle, ctx = None, None
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] == 0:
                handle, ctx = self._allreduce_grad_async(p)
            self._handles[p] = (handle, ctx)
        return hook

    def synchronize(self):
        """Nothing: ``step()`` applies the deltas (Horovod's)."""

    @contextmanager
    def skip_synchronize(self):
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for p in self._requires_update - set(self._handles):
            self._handles[p] = self._allreduce_grad_async(p)
        for p, (handle, ctx) in list(self._handles.items()):
            if handle is None:
                handle, ctx = self._allreduce_grad_async(p)
            delta = self._compression.decompress(mpi_ops.synchronize(handle), ctx)
            start = self._starting_models[p]
            start.data.add_(delta.data)
            p.data.copy_(start)
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._handles.clear()
        return loss

    def zero_grad(self, *args, **kwargs):
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                                 "or optimizer.synchronize(). This is prohibited as it can cause a race condition.")
        return super().zero_grad(*args, **kwargs)


def _named(param_groups, named_parameters) -> list:
    """``named_parameters`` as a list, checked as Horovod checks it (``ValueError``: not
    ``(name, tensor)`` tuples, duplicate names, parameters left unnamed); default names
    ``allreduce.noname.<group>.<index>``."""
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    else:
        named_parameters = [(f"allreduce.noname.{i}.{j}", v) for i, group in enumerate(param_groups)
                            for j, v in enumerate(group["params"])]
    if any(not isinstance(p, tuple) for p in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced "
                         "by model.named_parameters().")
    dups = _find_duplicates([k for k, _ in named_parameters])
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: "
                         + ", ".join(sorted(dups)))
    all_ids = {id(v) for group in param_groups for v in group["params"]}
    unnamed = all_ids - {id(v) for _, v in named_parameters}
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                         "Python object ids: " + ", ".join(str(i) for i in sorted(unnamed)))
    return named_parameters


def _find_duplicates(names) -> set:
    seen, dups = set(), set()
    for n in names:
        (dups if n in seen else seen).add(n)
    return dups


def _set_grad(p, value) -> None:
    """``p.grad`` holds ``value`` (nothing to do where the allreduce ran in ``p.grad`` itself)."""
    if value is not p.grad:
        p.grad.set_(value.to(p.grad.dtype) if value.dtype != p.grad.dtype else value)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=ReduceOp.AVERAGE, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=global_process_set):
    """Wrap a ``torch.optim.Optimizer`` so gradients are averaged over the ranks before each
    ``step()`` (see the module docstring).  Mirrors ``horovod.torch.DistributedOptimizer`` (same
    arguments and defaults; ``num_groups`` is Horovod's deprecated spelling of ``groups``)."""
    if gradient_predivide_factor != 1.0 and op != ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning)
        if groups is None:
            groups = num_groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if op == ReduceOp.ADASUM and mpi_ops.size() > 1:
        if api.process_set_id(process_set) != 0:
            raise NotImplementedError("Adasum does not support non-global process sets yet.")
        cls = type(optimizer.__class__.__name__, (_DistributedAdasumOptimizer, optimizer.__class__), {})
        return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step)
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set)

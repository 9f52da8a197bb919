"""Distributed optimizers for PyTorch: mirrors ``kungfu.torch.optimizers``."""
import torch

from sdp_kungfu_bridge.torch.ops import inplace_all_reduce_async_op, wait_handle

__all__ = ['SynchronousSGDOptimizer']


def SynchronousSGDOptimizer(optimizer: torch.optim.Optimizer, named_parameters, op=None):
    """``optimizer`` whose ``step()`` first reduces every gradient over the workers (``op``, by
    default ``'sum'``, as KungFu's: scale the learning rate, or pass ``'avg'``), named by its
    parameter's name, then steps; a parameter that requires a gradient and has none raises
    ``ValueError``.  Returns an object of a subclass of ``optimizer``'s class over
    the same parameter groups and state.  Mirrors ``kungfu.torch.optimizers.SynchronousSGDOptimizer``."""
    named = list(named_parameters)
    base = optimizer.__class__

    def sync_gradients(self):
        handles = []
        for name, p in self._kf_named:
            if p.requires_grad:
                if p.grad is None:
                    raise ValueError(f"SynchronousSGDOptimizer: parameter {name!r} has no gradient; every worker "
                                     "must have one for each parameter that requires it")
                handles.append(inplace_all_reduce_async_op(p.grad, name, self._kf_op))
        for h in handles:
            wait_handle(h)

    def step(self, closure=None):
        self.sync_gradients()
        return base.step(self, closure)

    cls = type(base.__name__, (base,), {"sync_gradients": sync_gradients, "step": step})
    sync = cls.__new__(cls)
    sync.__dict__.update(optimizer.__dict__)  # (the same param_groups, defaults and state)
    sync._kf_named, sync._kf_op = named, op
    return sync

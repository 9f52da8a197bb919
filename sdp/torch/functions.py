"""Horovod's PyTorch helpers on sdp (``horovod.torch.functions`` under ``sdprun --compat horovod``):
``broadcast_parameters``, ``broadcast_optimizer_state``, ``broadcast_object``, ``allgather_object``.
"""
import torch

from sdp import api
from sdp.process_sets import global_process_set
from sdp.torch import mpi_ops
from sdp.torch.optimizer import _DistributedOptimizer


def broadcast_parameters(params, root_rank: int) -> None:
    """Overwrite ``params`` with ``root_rank``'s values, in place: a ``dict`` (``model.state_dict()``:
    broadcast in sorted key order, named by key) or a list of tensors or of ``(name, tensor)``
    (``model.parameters()`` / ``model.named_parameters()``).  Every rank passes the same
    structure.  Mirrors ``horovod.torch.broadcast_parameters``; ``ValueError`` for another type."""
    if isinstance(params, dict):
        params = sorted(params.items())
    elif isinstance(params, list):
        params = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = [mpi_ops.broadcast_async_(p, root_rank, name) for name, p in params]
    for handle in handles:
        mpi_ops.synchronize(handle)


def broadcast_optimizer_state(optimizer, root_rank: int, model=None) -> None:
    """Give every rank ``root_rank``'s optimizer state: tensors of the state (momentum buffers,
    Adam's moments and ``step``) are broadcast in place, scalars of the state and the param
    groups' options (``lr``, ``betas``...) as one pickled object.  An optimizer without state yet
    takes one step on zero gradients first (a ``DistributedOptimizer`` steps without
    allreducing), as Horovod does.  ``model`` names sparse embeddings (their zero gradients are
    sparse).  Mirrors ``horovod.torch.broadcast_optimizer_state``; ``ValueError`` for
    ``torch.optim.LBFGS``."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    state_dict = optimizer.state_dict()
    sparse = set()
    if model is not None:
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding) and m.sparse:
                sparse.update(id(p) for p in m.parameters())
    if not state_dict["state"]:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = p.data.new(p.size()).zero_()
                    if isinstance(optimizer, torch.optim.SparseAdam) or (
                            isinstance(optimizer, torch.optim.SGD) and id(p) in sparse):
                        p.grad = p.grad.to_sparse()
        if isinstance(optimizer, _DistributedOptimizer):
            super(_DistributedOptimizer, optimizer).step()  # (the wrapped optimizer's: no allreduce)
        else:
            optimizer.step()
        state_dict = optimizer.state_dict()
    if not state_dict["state"]:
        return  # a stateless optimizer
    params, scalars, callbacks, occurrences = [], {}, {}, {}

    def set_option(index, key):
        return lambda v: optimizer.param_groups[index].__setitem__(key, v)

    def set_state(pid, key):
        return lambda v: state_dict["state"][pid].__setitem__(key, v)

    for index, group in enumerate(state_dict["param_groups"]):
        for key, value in group.items():
            if key != "params":
                scalars[f"{key}.{index}"] = value
                callbacks[f"{key}.{index}"] = set_option(index, key)
        for pid in group["params"]:
            if pid not in state_dict["state"]:
                continue
            for key, value in state_dict["state"][pid].items():
                occurrences[key] = occurrences.get(key, 0) + 1
                name = f"{key}.{occurrences[key]}"
                if torch.is_tensor(value):
                    params.append((name, value))
                else:
                    scalars[name] = value
                    callbacks[name] = set_state(pid, key)
    broadcast_parameters(params, root_rank)
    for key, value in broadcast_object(scalars, root_rank).items():
        callbacks[key](value)


def broadcast_object(obj, root_rank: int = 0, name=None, process_set=global_process_set):
    """Pickle ``obj`` on ``root_rank`` and return it on every rank of ``process_set``.  Mirrors
    ``horovod.torch.broadcast_object``."""
    return api.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj, name=None):
    """Pickle ``obj`` on every rank and return the list of them in rank order.  Mirrors
    ``horovod.torch.allgather_object``."""
    return api.allgather_object(obj, name)

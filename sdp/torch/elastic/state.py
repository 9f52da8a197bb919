"""Horovod's ``TorchState`` (``horovod.torch.elastic.state``): the elastic state of PyTorch models,
optimizers and ``ElasticSampler`` objects plus plain attributes.

Every keyword argument becomes an attribute.  Values of a known type get a handler (the registry,
``get_handler_registry`` / ``set_handler_registry``): ``torch.nn.Module`` (``save`` keeps
a deep copy of its ``state_dict``, ``sync`` broadcasts rank 0's parameters and buffers in place),
``torch.optim.Optimizer`` (its ``state_dict``; ``sync`` is
``broadcast_optimizer_state``), ``ElasticSampler`` (its position;
``sync`` takes rank 0's); anything else is saved, restored and synchronized as an object
(``sdp.elastic.ObjectState``).  Assigning a new value to a handled attribute saves it.
"""
import copy

import torch

from sdp import api
from sdp.elastic import ObjectState
from sdp.torch.elastic.sampler import ElasticSampler
from sdp.torch.functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters


class TorchState(ObjectState):
    """Elastic state of ``model``, ``optimizer`` and any keyword attributes (see the module
    docstring).  Mirrors ``horovod.torch.elastic.TorchState``."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        self._handlers, kwargs = _get_handlers(kwargs)
        for name, handler in self._handlers.items():
            setattr(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=api.rank, **kwargs)

    def save(self):
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self):
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self):
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name, value):
        if hasattr(self, name) and name in self._handlers:
            self._handlers[name].set_value(value)
        super().__setattr__(name, value)


class StateHandler:
    """Saves, restores and synchronizes one value of a ``TorchState``."""

    def __init__(self, value):
        self.value = value
        self.save()

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError

    def set_value(self, value):
        self.value = value
        self.save()


class _StateDictHandler(StateHandler):
    """A value with ``state_dict()`` / ``load_state_dict()``: ``save`` keeps a deep copy of its
    state dict, ``restore`` loads it back."""

    def save(self):
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self._saved)


class ModelStateHandler(_StateDictHandler):
    """A ``torch.nn.Module``: its ``state_dict`` (parameters and buffers); ``sync`` broadcasts
    rank 0's in place."""

    def sync(self):
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(_StateDictHandler):
    """A ``torch.optim.Optimizer``: its ``state_dict``; ``sync`` is ``broadcast_optimizer_state``."""

    def sync(self):
        broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(_StateDictHandler):
    """An ``ElasticSampler``: its epoch and processed count; ``sync`` takes rank 0's."""

    def sync(self):
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))


_handler_registry = [(torch.nn.Module, ModelStateHandler), (torch.optim.Optimizer, OptimizerStateHandler),
                     (ElasticSampler, SamplerStateHandler)]


def get_handler_registry() -> list:
    """``[(type, handler class)]``, first match wins.  Mirrors Horovod's."""
    return _handler_registry


def set_handler_registry(registry: list) -> None:
    """Replace the handler registry.  Mirrors Horovod's."""
    global _handler_registry
    _handler_registry = registry


def _get_handlers(kwargs: dict):
    handlers, rest = {}, {}
    for k, v in kwargs.items():
        cls = next((h for t, h in _handler_registry if isinstance(v, t)), None)
        if cls is not None:
            handlers[k] = cls(v)
        else:
            rest[k] = v
    return handlers, rest

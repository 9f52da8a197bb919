"""Distributed MindSpore optimizers on sdp: mirrors the KungFu fork's ``mindspore.nn.optim.kungfu``.

Under ``sdprun --compat kungfu`` (or after ``sdp_kungfu_bridge.mindspore.install``) this module
*is* ``mindspore.nn.optim.kungfu``.

``KungFuMomentum(params, learning_rate, momentum, ...)`` and ``KungFuSGD(params, ...)`` take
``mindspore.nn.Momentum`` / ``SGD``'s arguments and are subclasses of them.  Their ``construct``
allreduces every gradient with ``KungFuAllReduce`` through
``C.Map`` (one collective per gradient, as the fork) and then applies the parent's update: the
gradients are **summed** over the workers, not averaged, as in the fork (scale the learning rate
by ``1 / cluster size`` for the single-worker step size).

``KungFuGroupedMomentum`` / ``KungFuGroupedSGD``: the same update, but all gradients go to the
engine as one request (``KungFuGroupAllReduce``), which
fuses the gradients of one dtype into one collective; fewer, larger messages (see
``benchmarks/mindspore_step.py``).

``build_optimizer(args, network)``: the fork's example helper: ``args.lr``, ``args.momentum``;
``KungFuMomentum`` when ``args.use_kungfu`` (default true here), plain ``Momentum`` otherwise;
``args.grouped`` picks the grouped variant.

MindSpore 2.10 PYNATIVE workaround
    ``nn.Momentum.construct`` (and ``SGD``'s) is decorated with ``@jit``.  In PYNATIVE mode, a
    subclass ``construct`` that calls ``super().construct(gradients)`` makes MindSpore's JIT
    fallback evaluate the *subclass* ``construct`` a second time while compiling the parent's
    graph: the gradients are allreduced twice (summed twice), silently.  So in PYNATIVE mode these
    classes call the parent's undecorated ``construct`` (the same update, run op by op) instead;
    in GRAPH mode (the whole step compiled) ``super().construct`` is used as usual.  A
    hand-written subclass of ``nn.Momentum`` in the guide's style is re-run too; there the ops
    skip the compiled re-run (see "PYNATIVE subclasses" in ``sdp_kungfu_bridge.mindspore.ops``),
    so it also reduces once (tests/test_kungfu_mindspore.py counts the requests).
    The mode is read when the optimizer is built: build it after ``set_context(mode=...)``.
"""
import inspect

import mindspore as ms
from mindspore.ops import composite as C

from sdp_kungfu_bridge.mindspore.ops import KungFuAllReduce, KungFuGroupAllReduce

__all__ = ['KungFuGroupedMomentum', 'KungFuGroupedSGD', 'KungFuMomentum', 'KungFuSGD', 'build_optimizer']


def _pynative() -> bool:
    return ms.get_context("mode") == ms.PYNATIVE_MODE


class _Distributed:
    """Mixin: gradients reduced before the parent optimizer's update (see the module docstring).
    ``_grouped``: one ``KungFuGroupAllReduce`` of all gradients instead of one
    ``KungFuAllReduce`` per gradient."""

    _grouped = False
    _kungfu_no_rerun = True  # PYNATIVE: the parent's undecorated update, never a compiled re-run

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        parent = next(c for c in type(self).__mro__ if "construct" in c.__dict__ and not issubclass(c, _Distributed))
        self._kungfu_parent_construct = inspect.unwrap(parent.construct)
        self.map_ = C.Map()
        self.all_reduce = KungFuGroupAllReduce(len(self._parameters)) if self._grouped else KungFuAllReduce('sum')
        self._kungfu_grouped = self._grouped
        self._kungfu_eager = _pynative()  # read here: construct may not call get_context

    def _kungfu_reduce(self, gradients):
        if self._kungfu_grouped:
            return self.all_reduce(*gradients)
        return self.map_(self.all_reduce, gradients)


class KungFuMomentum(_Distributed, ms.nn.Momentum):
    """``nn.Momentum`` with gradients summed over the cluster (one allreduce per gradient)."""

    def construct(self, gradients):
        gradients = self._kungfu_reduce(gradients)
        if self._kungfu_eager:  # PYNATIVE: the parent's undecorated update (MindSpore 2.10 bug, above)
            return self._kungfu_parent_construct(self, gradients)
        return super(KungFuMomentum, self).construct(gradients)


class KungFuSGD(_Distributed, ms.nn.SGD):
    """``nn.SGD`` with gradients summed over the cluster (one allreduce per gradient)."""

    def construct(self, gradients):
        gradients = self._kungfu_reduce(gradients)
        if self._kungfu_eager:
            return self._kungfu_parent_construct(self, gradients)
        return super(KungFuSGD, self).construct(gradients)


class KungFuGroupedMomentum(KungFuMomentum):
    """``nn.Momentum`` with all gradients summed in one fused request."""

    _grouped = True


class KungFuGroupedSGD(KungFuSGD):
    """``nn.SGD`` with all gradients summed in one fused request."""

    _grouped = True


def build_optimizer(args, network):
    """The fork example's helper: ``Momentum(network.trainable_params(), args.lr, args.momentum)``,
    distributed when ``args.use_kungfu`` (default true), grouped when ``args.grouped``."""
    if not getattr(args, 'use_kungfu', True):
        cls = ms.nn.Momentum
    elif getattr(args, 'grouped', False):
        cls = KungFuGroupedMomentum
    else:
        cls = KungFuMomentum
    return cls(network.trainable_params(), args.lr, args.momentum)

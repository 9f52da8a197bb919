"""Distributed MindSpore optimizers on sdp: mirrors the KungFu fork's ``mindspore.nn.optim.kungfu``.

Under ``sdprun --compat kungfu`` (or after :func:`sdp_kungfu_bridge.mindspore.install`) this module
*is* ``mindspore.nn.optim.kungfu``.

``KungFuMomentum(params, learning_rate, momentum, ...)`` and ``KungFuSGD(params, ...)`` take
``mindspore.nn.Momentum`` / ``SGD``'s arguments and are subclasses of them.  Their ``construct``
allreduces every gradient with :class:`~sdp_kungfu_bridge.mindspore.ops.KungFuAllReduce` through
``C.Map`` (one collective per gradient, as the fork) and then applies the parent's update: the
gradients are **summed** over the workers, not averaged, as in the fork (scale the learning rate
by ``1 / cluster size`` for the single-worker step size).

``KungFuGroupedMomentum`` / ``KungFuGroupedSGD``: the same update, but all gradients go to the
engine as one request (:class:`~sdp_kungfu_bridge.mindspore.ops.KungFuGroupAllReduce`), which
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
    hand-written subclass of ``nn.Momentum`` in the guide's style has the bug in PYNATIVE mode;
    use these classes there (tests/test_kungfu_mindspore.py shows both).
"""
import inspect

import mindspore as ms
from mindspore.ops import composite as C

from sdp_kungfu_bridge.mindspore.ops import KungFuAllReduce, KungFuGroupAllReduce

__all__ = ['KungFuGroupedMomentum', 'KungFuGroupedSGD', 'KungFuMomentum', 'KungFuSGD', 'build_optimizer']


def _pynative() -> bool:
    return ms.get_context("mode") == ms.PYNATIVE_MODE


class _Distributed:
    """Mixin: gradients reduced before the parent optimizer's update (see the module docstring)."""

    def _kungfu_setup(self, grouped: bool):
        parent = next(c for c in type(self).__mro__ if c is not _Distributed and "construct" in c.__dict__
                      and not issubclass(c, _Distributed))
        self._kungfu_parent_construct = inspect.unwrap(parent.construct)
        self.map_ = C.Map()
        self.all_reduce = KungFuGroupAllReduce(len(self._parameters), 'sum') if grouped else KungFuAllReduce('sum')
        self._kungfu_grouped = grouped
        self._kungfu_eager = _pynative()  # read here: construct may not call get_context

    def _kungfu_update(self, gradients):
        """PYNATIVE: the parent's undecorated update (MindSpore 2.10 bug, see above)."""
        return self._kungfu_parent_construct(self, gradients)


class KungFuMomentum(_Distributed, ms.nn.Momentum):
    """``nn.Momentum`` with gradients summed over the cluster (one allreduce per gradient)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._kungfu_setup(grouped=False)

    def construct(self, gradients):
        gradients = self.map_(self.all_reduce, gradients)
        if self._kungfu_eager:
            return self._kungfu_update(gradients)
        return super().construct(gradients)


class KungFuSGD(_Distributed, ms.nn.SGD):
    """``nn.SGD`` with gradients summed over the cluster (one allreduce per gradient)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._kungfu_setup(grouped=False)

    def construct(self, gradients):
        gradients = self.map_(self.all_reduce, gradients)
        if self._kungfu_eager:
            return self._kungfu_update(gradients)
        return super().construct(gradients)


class KungFuGroupedMomentum(_Distributed, ms.nn.Momentum):
    """``nn.Momentum`` with all gradients summed in one fused request."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._kungfu_setup(grouped=True)

    def construct(self, gradients):
        gradients = self.all_reduce(*gradients)
        if self._kungfu_eager:
            return self._kungfu_update(gradients)
        return super().construct(gradients)


class KungFuGroupedSGD(_Distributed, ms.nn.SGD):
    """``nn.SGD`` with all gradients summed in one fused request."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._kungfu_setup(grouped=True)

    def construct(self, gradients):
        gradients = self.all_reduce(*gradients)
        if self._kungfu_eager:
            return self._kungfu_update(gradients)
        return super().construct(gradients)


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

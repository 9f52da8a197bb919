"""Reduction operations, with Horovod's numeric values and SMDDP's names.

Mirrors ``horovod.tensorflow.{Average,Sum,Adasum,Min,Max,Product}`` and
``smdistributed.dataparallel.tensorflow.ReduceOp.{AVERAGE,SUM,MIN,MAX}``.
"""
import enum

import numpy as np


class ReduceOp(enum.IntEnum):
    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

# In-place binary ufunc used to combine two partial results (AVERAGE sums, then scales once).
UFUNCS = {
    ReduceOp.AVERAGE: np.add,
    ReduceOp.SUM: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
}


def resolve_op(op=None, average=None) -> ReduceOp:
    """Turn ``op``/legacy ``average=`` (Horovod) into a :class:`ReduceOp`.

    ``op=None`` and ``average=None`` mean AVERAGE (Horovod's and SMDDP's default).
    Raises ``ValueError`` when both are given or ``op`` is unknown.
    """
    if type(op) is ReduceOp and average is None:
        return op
    if average is not None:
        if op is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    if op is None:
        return ReduceOp.AVERAGE
    try:
        return ReduceOp(int(op))
    except (ValueError, TypeError):
        raise ValueError(f"unknown reduce op {op!r}; expected one of {[o.name for o in ReduceOp]}") from None

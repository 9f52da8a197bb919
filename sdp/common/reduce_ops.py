"""Reduction operations, with Horovod's numeric values and SMDDP's names.

Mirrors ``horovod.tensorflow.{Average,Sum,Adasum,Min,Max,Product}`` and
``smdistributed.dataparallel.tensorflow.ReduceOp.{AVERAGE,SUM,MIN,MAX}``.
"""
import enum
import functools
from typing import Optional

import numpy as np


class ReduceOp(enum.IntEnum):
    """How a collective combines the ranks' values, with Horovod's numeric values: ``AVERAGE``
    (0: the sum divided by the number of ranks), ``SUM`` (1), ``ADASUM`` (2), ``MIN`` (3), ``MAX``
    (4), ``PRODUCT`` (5).  Mirrors ``horovod.tensorflow``'s reduce ops."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average = ReduceOp.AVERAGE
"""``ReduceOp.AVERAGE``: the sum over the ranks divided by their number (Horovod's ``hvd.Average``)."""
Sum = ReduceOp.SUM
"""``ReduceOp.SUM``: the sum over the ranks (Horovod's ``hvd.Sum``)."""
Adasum = ReduceOp.ADASUM
"""``ReduceOp.ADASUM``: Horovod's adaptive summation (``hvd.Adasum``)."""
Min = ReduceOp.MIN
"""``ReduceOp.MIN``: the elementwise minimum over the ranks (Horovod's ``hvd.Min``)."""
Max = ReduceOp.MAX
"""``ReduceOp.MAX``: the elementwise maximum over the ranks (Horovod's ``hvd.Max``)."""
Product = ReduceOp.PRODUCT
"""``ReduceOp.PRODUCT``: the elementwise product over the ranks (Horovod's ``hvd.Product``)."""

# In-place binary ufunc used to combine two partial results (AVERAGE sums, then scales once).
UFUNCS = {
    ReduceOp.AVERAGE: np.add,
    ReduceOp.SUM: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
}


def scale_in_place(buf: np.ndarray, factor: float) -> None:
    """``buf *= factor`` as Horovod scales: 16-bit floats (float16, bfloat16) in float32, rounded
    once (the factor itself is not rounded to 16 bits first); other floats in their own dtype;
    integers in float64, truncated."""
    if factor == 1.0:
        return
    if buf.dtype.kind == "f" and buf.dtype.itemsize == 2 or buf.dtype.name == "bfloat16":
        np.multiply(buf, np.float32(factor), out=buf, dtype=np.float32, casting="unsafe")
    else:
        np.multiply(buf, factor, out=buf, casting="unsafe")


def resolve_op(op=None, average=None) -> ReduceOp:
    """Turn ``op``/legacy ``average=`` (Horovod) into a ``ReduceOp``.

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


def check_dtype(kind: str, name: str, dtype, op: ReduceOp = ReduceOp.SUM, prescale: float = 1.0,
                postscale: float = 1.0, shown: str = None) -> None:
    """Raise ``ValueError`` (naming the collective ``kind``, the tensor and ``shown`` or the dtype)
    unless collective ``kind`` can carry ``dtype``.  Reductions (allreduce, reducescatter) take
    bool (SUM/MAX: logical or, MIN/PRODUCT: logical and; no AVERAGE, no scale factors), signed
    and unsigned ints, float16, bfloat16, float32, float64; the other collectives any dtype
    without Python objects.  Adasum: allreduce of float16, float32 or float64 only (Horovod's)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iuf" and op != ReduceOp.ADASUM:  # (any collective, any op and scale: the common case)
        return
    if op == ReduceOp.ADASUM and kind in ("allreduce", "reducescatter"):
        if kind != "allreduce" or dtype.name not in ("float16", "float32", "float64"):
            raise ValueError(f"{kind} of '{name}': op Adasum takes an allreduce of float16, float32 or float64, "
                             f"got {kind} of {shown or dtype}")
        return
    if kind not in ("allreduce", "reducescatter"):
        if dtype.hasobject:
            raise ValueError(f"{kind} of '{name}': dtype {shown or dtype} is not supported (Python objects)")
        return
    if not (dtype.kind in "biuf" or dtype.name == "bfloat16"):
        raise ValueError(f"{kind} of '{name}': dtype {shown or dtype} is not supported (reductions take bool, "
                         "signed/unsigned ints, float16, bfloat16, float32, float64; other collectives "
                         "any dtype without Python objects)")
    if dtype == np.bool_ and (op == ReduceOp.AVERAGE or prescale != 1.0 or postscale != 1.0):
        raise ValueError(f"{kind} of '{name}': bool tensors take SUM/MAX (logical or) or MIN/PRODUCT "
                         f"(logical and) without scale factors; got {ReduceOp(op).name}, "
                         f"prescale {prescale:g}, postscale {postscale:g}")


@functools.lru_cache(maxsize=None)
def accumulation_dtype(dtype: np.dtype) -> Optional[np.dtype]:
    """float32 for 16-bit floats (float16, bfloat16): sums never overflow or lose small terms
    in the 16-bit format while they are being accumulated."""
    if dtype.kind == "f" and dtype.itemsize == 2 or dtype.name == "bfloat16":
        return np.dtype(np.float32)
    return None

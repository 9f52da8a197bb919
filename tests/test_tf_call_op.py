"""sdp's compiled ``SdpCall`` op (sdp/tensorflow/cc/sdp_ops.cc, issue 30 item 4), in one process:
every dtype it carries in and out, shapes from scalars to empty, outputs shared without a copy
when aligned and copied when not, errors as the statuses a numpy_function's kernel (or Horovod's,
for a mismatch) would give, and the function forgotten with its graph."""
import gc

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from sdp.common import errors  # noqa: E402
from sdp.tensorflow import build_ops, ops  # noqa: E402

pytestmark = pytest.mark.tf


@pytest.fixture(scope="module")
def lib():
    got = build_ops.load()
    if got is None or not got.calls:
        pytest.skip("sdp's compiled op (SdpCall) is not built here")
    return got


def _run(lib, fn, inputs, dtypes):
    """``fn`` through ``_checked_numpy_function`` in a tf.function: the op must be SdpCall."""
    kinds = []

    @tf.function(autograph=False)
    def graph(*xs):
        outs = ops._checked_numpy_function(fn, list(xs), dtypes, "t", on_op=lambda op: kinds.append(op.type))
        return outs

    out = graph(*inputs)
    assert kinds == ["SdpCall"], kinds
    return out


@pytest.mark.parametrize("name", sorted(build_ops.CALL_DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3)])
def test_every_dtype_and_shape_goes_in_and_out(lib, name, shape):
    dtype = tf.as_dtype(name)
    x = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape).astype(dtype.as_numpy_dtype)

    def twice(a):
        return [a | a if a.dtype == np.bool_ else a + a, a.reshape(-1)[::-1]]  # (the second: not contiguous)

    def inside(a):  # (a read-only view of the input tensor)
        assert a.dtype == x.dtype and a.shape == x.shape and not a.flags.writeable
        return twice(a)

    got = _run(lib, inside, [tf.constant(x)], [dtype, dtype])
    want = twice(x)
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.shape == w.shape and np.array_equal(g.numpy(), w), (name, shape)


def test_aligned_results_are_shared_and_others_copied(lib):
    def at(offset):  # 256 floats ``offset`` bytes after a 64-byte boundary
        raw = np.zeros(64 + 1024 + 16, np.uint8)
        skip = -raw.ctypes.data % 64 + offset
        return raw[skip:skip + 1024].view(np.float32)

    aligned, shifted = at(0), at(4)
    aligned[:], shifted[:] = 1.0, 2.0
    results = {"aligned": aligned, "shifted": shifted}
    seen = {}
    def graph_returning(arr):
        @tf.function(autograph=False)
        def graph(x):
            out = lib.call(lambda a: [arr], [x], [tf.float32])[0]
            return out, lib.module.sdp_buffer_address(out)
        return graph

    for key, arr in results.items():
        out, address = graph_returning(arr)(tf.zeros(1))
        seen[key] = int(address) == arr.ctypes.data
        assert np.array_equal(out.numpy(), np.full(256, 1.0 if key == "aligned" else 2.0, np.float32)), key
    assert seen == {"aligned": True, "shifted": False}, seen


@pytest.mark.parametrize("error, cls", [
    (ValueError("bad value"), tf.errors.InvalidArgumentError),
    (TypeError("bad type"), tf.errors.InvalidArgumentError),
    (MemoryError("no memory"), tf.errors.ResourceExhaustedError),
    (NotImplementedError("not yet"), tf.errors.UnimplementedError),
    (RuntimeError("boom"), tf.errors.UnknownError),
    (errors.TensorMismatchError("shape mismatch, rank 0 has [1], rank 1 has [2]"),
     tf.errors.FailedPreconditionError),
])
def test_errors_become_the_statuses_a_numpy_function_or_horovod_would_give(lib, error, cls):
    def fail(a):
        raise error

    with pytest.raises(cls) as got:
        _run(lib, fail, [tf.ones(2)], [tf.float32])
    assert str(error) in got.value.message and type(got.value) is cls, got.value.message


def test_a_wrong_result_is_an_internal_error_and_inputs_are_read_only(lib):
    with pytest.raises(tf.errors.InternalError, match="one array per output"):
        _run(lib, lambda a: [a, a], [tf.ones(2)], [tf.float32])

    def write(a):
        a[0] = 5.0
        return [a]

    with pytest.raises(tf.errors.InvalidArgumentError, match="read-only"):
        _run(lib, write, [tf.ones(2)], [tf.float32])


def test_the_function_is_forgotten_with_its_graph(lib):
    with tf.Graph().as_default() as g:
        out = lib.call(lambda a: [a], [tf.constant([1.0, 2.0])], [tf.float32])[0]
        with tf.compat.v1.Session(graph=g) as sess:
            assert list(sess.run(out)) == [1.0, 2.0]
    token = max(lib._functions.keys())
    del g, out, sess
    gc.collect()
    assert token not in lib._functions

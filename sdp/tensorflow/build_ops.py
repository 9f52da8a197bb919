"""Build and load sdp's compiled TensorFlow ops, ``SdpCall`` and ``SdpCheck`` (``sdp/tensorflow/cc/sdp_ops.cc``).

``SdpCall`` (built where Python's and numpy's headers are there; ``Library.calls``) runs a
graph collective's Python function instead of a ``tf.numpy_function`` (``Library.call``):
its kernel calls the function with numpy views of its inputs and takes the returned arrays as
its outputs, or a returned ``(code, message)`` as its status (Horovod's classes, without
``SdpCheck``).  It saves ~30 us of a ``tf.function``'s 1 KB allreduce (201-202 -> 170-171 us,
``benchmarks/tf_call_op.py``).  Where it is not built, graph collectives are ``numpy_function``
ops followed by ``SdpCheck``:

Why: in ``tf.function`` and ``tf.compat.v1`` graphs sdp's collectives are ``tf.numpy_function``
ops, and TensorFlow gives an exception raised there a status by its Python class only
(``ValueError`` -> ``InvalidArgumentError``).  Horovod's kernels fail a mismatch across ranks with
``tf.errors.FailedPreconditionError``.  With this library loaded, a graph collective's
``numpy_function`` that fails with such an error returns a one-element placeholder as its first
result instead of raising, registered (``Library.register``) with the status, and the
``SdpCheck`` op fed its results fails with that status, or forwards them without a copy (see
``sdp.tensorflow.ops``).  When loaded, a self-test checks that TensorFlow takes such a
placeholder without a copy (else the op could not recognise it, and the library is not used).

Building (needs a C++ compiler: ``$CXX``, else ``g++``, ``c++`` or ``clang++``; ~5-10 s):

* ``python -m sdp.tensorflow.build_ops`` compiles it now (``--force`` recompiles) and prints the
  library's path; run it once after installing (``.ci/run`` does).
* Otherwise the first graph collective of a process builds it (every rank at once: under a file
  lock, so one process per cache directory compiles and the others wait, then load it), and
  says so first, in one warning per process: a first step that takes 10-30 s longer is explained.
* The library lives in ``$SDP_CACHE_DIR/tf_ops/`` (default ``$XDG_CACHE_HOME/sdp`` or
  ``~/.cache/sdp``), named by TensorFlow's version and a hash of the source, TensorFlow's compile
  and link flags and the Python ABI: a new TensorFlow or sdp version builds a new one.

``SDP_TF_OPS=0`` never loads or builds it: graph collectives then raise what TensorFlow makes of
sdp's Python errors (``InvalidArgumentError`` for a mismatch), as they also do when no compiler
is found or the build or load fails (logged once per process on the ``sdp.tensorflow`` logger,
with the reason).  ``launcher`` code (``sdprun``) never builds it.
"""
import ctypes
import itertools
import logging
import platform
import sys
import sysconfig
import threading
import weakref
from pathlib import Path
from typing import Optional

from sdp.common import native_build
from sdp.common.native_build import BuildError

log = logging.getLogger("sdp.tensorflow")

SOURCE = Path(__file__).resolve().parent / "cc" / "sdp_ops.cc"
#: the dtypes (``tf.DType.name``) SdpCall carries, as numpy arrays (``NumpyType`` in sdp_ops.cc)
CALL_DTYPES = frozenset(("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
                         "uint32", "uint64", "bool", "complex64", "complex128"))
SWITCH = "SDP_TF_OPS"  # 0: never use the compiled op (graph errors by Python class, as without one)

_lock = threading.Lock()
_state = {}  # "lib": the loaded module or None once load() decided; "why": the reason for None


class Library:
    """The loaded library: ``check`` builds an ``SdpCheck`` op; ``register`` and
    ``pending`` are its C functions (through ``ctypes``) for a failed collective's placeholder."""

    def __init__(self, module, path: Path, align: int):
        self.module = module
        self.path = path
        self.align = align  # TensorFlow takes a numpy_function result without a copy at this alignment
        native = ctypes.CDLL(str(path))  # the library TensorFlow loaded (one handle, one registry)
        #: whether SdpCall was built (``call``)
        self.calls = hasattr(module, "sdp_call")
        self._functions = weakref.WeakValueDictionary()  # token -> SdpCall's function (its graph holds it)
        self._tokens = itertools.count()
        if self.calls:  # (a PyDLL call: with the GIL held)
            registry = ctypes.PyDLL(str(path)).sdp_call_registry
            registry.argtypes, registry.restype = [ctypes.py_object], None
            registry(self._functions)
        self._fail = native.sdp_check_fail
        self._fail.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int64]
        self._fail.restype = None
        self._pending = native.sdp_check_pending
        self._pending.argtypes = [ctypes.c_void_p]
        self._pending.restype = ctypes.c_int

    def check(self, tensors, name=None) -> list:
        """``SdpCheck(tensors)``: the same tensors (no copy), or the registered status when the
        first one's buffer is a registered placeholder."""
        return list(self.module.sdp_check(list(tensors), name=name))

    def call(self, fn, inputs, dtypes, name=None):
        """``SdpCall``: the tensors of ``dtypes`` (inputs and outputs of the dtypes in
        ``CALL_DTYPES``) that ``fn(*input arrays)`` returns, a list of C-contiguous arrays
        of those dtypes, or a ``(code, message bytes)`` tuple: the op fails with that status.
        With no ``dtypes`` (a side effect: ``fn`` returns ``[]``), the operation.  ``fn`` is kept
        alive by the outermost graph (the op finds it by a token; it is forgotten with that
        graph)."""
        import tensorflow as tf
        token = next(self._tokens)
        self._functions[token] = fn
        graph = tf.compat.v1.get_default_graph()
        while getattr(graph, "outer_graph", None) is not None:  # (held by the outermost graph, as
            graph = graph.outer_graph  # numpy_function's functions are)
        if not hasattr(graph, "_sdp_calls"):
            graph._sdp_calls = []
        graph._sdp_calls.append(fn)
        outs = self.module.sdp_call(list(inputs), token=token, Tout=list(dtypes), name=name)
        return list(outs) if dtypes else outs

    def placeholder(self, dtype):
        """A new one-element array of ``dtype`` aligned so TensorFlow takes it without a copy."""
        import numpy as np
        dtype = np.dtype(dtype)
        raw = np.zeros(dtype.itemsize + self.align, np.uint8)
        skip = -raw.ctypes.data % self.align
        return raw[skip:skip + dtype.itemsize].view(dtype)

    def register(self, address: int, code: int, message: bytes) -> None:
        """The ``SdpCheck`` op whose first input is the buffer at ``address`` fails with ``(code,
        message)`` (``code`` an ``absl::StatusCode``; the entry is dropped when that op runs)."""
        self._fail(address, int(code), message, len(message))

    def pending(self, address: int) -> bool:
        """True while the buffer at ``address`` is registered and its op has not run."""
        return bool(self._pending(address))


def enabled() -> bool:
    """False when ``SDP_TF_OPS=0`` (or ``false``/``off``/``no``) says not to use the compiled op."""
    return native_build.switched_on(SWITCH)


def cache_dir() -> Path:
    """Where built libraries are kept: ``$SDP_CACHE_DIR/tf_ops`` (default ``$XDG_CACHE_HOME/sdp``,
    else ``~/.cache/sdp``)."""
    return native_build.cache_dir("tf_ops")


def _tf_flags():
    import tensorflow as tf
    return tf.__version__, list(tf.sysconfig.get_compile_flags()), list(tf.sysconfig.get_link_flags())


def library_path() -> Path:
    """The library for this TensorFlow and this source (it may not exist yet)."""
    version, cflags, lflags = _tf_flags()
    import numpy
    h = native_build.digest(SOURCE, [version, sys.implementation.cache_tag, platform.machine(), numpy.__version__,
                                     *cflags, *_call_flags(), *lflags])
    return cache_dir() / f"sdp_ops-tf{version}-{h}.so"


def compiler() -> Optional[list]:
    """The C++ compiler's command (``$CXX`` split as a shell would, else the first of ``g++``,
    ``c++``, ``clang++`` on ``PATH``), or None."""
    return native_build.compiler("CXX", ("g++", "c++", "clang++"))


def build(force: bool = False) -> Path:
    """Compile the library into ``cache_dir`` unless it is there (``force``: compile anyway)
    and return its path.  Concurrent callers (ranks of a job) compile once: the first takes the
    directory's lock, the others wait for it and find the library.  Raises ``BuildError``
    when there is no compiler or it fails."""
    out = library_path()
    if out.exists() and not force:
        return out
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler: set CXX or install g++ (e.g. apt-get install g++)")
    log.warning("sdp: building sdp's TensorFlow op into %s (once per TensorFlow version, 10-30 s; "
                "`python -m sdp.tensorflow.build_ops` builds it ahead of a job)", out.parent)
    _, cflags, lflags = _tf_flags()
    return native_build.build(out, lambda tmp: [*cxx, "-shared", "-fPIC", "-O2", "-Wno-deprecated-declarations",
                                                str(SOURCE), "-o", tmp, *cflags, *_call_flags(), *lflags], force)


def _call_flags() -> list:
    """The flags that build ``SdpCall``: Python's and numpy's headers, where both are there."""
    import numpy
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").exists():
        return []
    return ["-DSDP_CALL", f"-I{include}", f"-I{numpy.get_include()}"]


def load(build_missing: bool = True) -> Optional[Library]:
    """The loaded ``Library``, or None when graph collectives go without it: ``SDP_TF_OPS=0``,
    no compiler, a failed build, load or self-test.
    Decided once per process (a missing library is built first when ``build_missing``); the
    reason for None is logged once."""
    if not enabled():
        return None
    with _lock:
        if "lib" not in _state:
            _state["lib"], _state["why"] = _load(build_missing)
            if _state["lib"] is None:
                log.warning("sdp: graph-mode collectives raise TensorFlow's InvalidArgumentError where Horovod "
                            "raises FailedPreconditionError (sdp's compiled op is not loaded: %s). Build it with "
                            "`python -m sdp.tensorflow.build_ops`; SDP_TF_OPS=0 silences this.", _state["why"])
        return _state["lib"]


def _align() -> int:
    """TensorFlow's ``EIGEN_MAX_ALIGN_BYTES`` (its compile flags; 64 if they do not say)."""
    for flag in _tf_flags()[1]:
        if flag.startswith("-DEIGEN_MAX_ALIGN_BYTES="):
            return max(1, int(flag.split("=", 1)[1]))
    return 64


def _load(build_missing: bool):
    import tensorflow as tf
    try:
        path = library_path()
        if not path.exists():
            if not build_missing:
                return None, f"{path} does not exist"
            path = build()
        lib = Library(tf.load_op_library(str(path)), path, _align())
    except BuildError as e:
        return None, f"building it failed: {e}"
    except (OSError, AttributeError, tf.errors.OpError) as e:  # pragma: no cover - e.g. another TensorFlow's
        return None, f"loading it failed: {e}"
    why = _self_test(lib)
    return (None, why) if why else (lib, "")


def _self_test(lib: Library) -> str:
    """'' if TensorFlow takes an aligned ``numpy_function`` result without a copy (``SdpCheck``
    recognises a failed op's placeholder by its buffer's address), else why not.  Runs in a
    ``Session`` of its own graph, so it also works while a function is being traced."""
    import numpy as np
    import tensorflow as tf
    held = []

    def body(_):
        held.append(lib.placeholder(np.float32))
        return held[-1]

    with tf.Graph().as_default() as g:
        address = lib.module.sdp_buffer_address(tf.numpy_function(body, [tf.constant(0.0)], tf.float32,
                                                                  stateful=True))
        with tf.compat.v1.Session(graph=g) as sess:
            got = int(sess.run(address))
    if got != held[0].ctypes.data:  # pragma: no cover - a TensorFlow that copies numpy_function results
        return "its self-test failed: TensorFlow copied a numpy_function's aligned result"
    if lib.calls and not _call_works(lib):  # pragma: no cover - SdpCall broken here: numpy_function instead
        log.warning("sdp: graph collectives stay tf.numpy_function ops (sdp's SdpCall op failed its self-test)")
        lib.calls = False
    return ""


def _call_works(lib: Library) -> bool:
    """Whether an ``SdpCall`` op returns what its function computes (its failures are not tried
    here: TensorFlow logs a warning for each)."""
    import numpy as np
    import tensorflow as tf
    with tf.Graph().as_default() as g:
        x = tf.constant(np.arange(6, dtype=np.float32).reshape(2, 3))
        y = lib.call(lambda a: [a * 2], [x], [tf.float32])[0]
        with tf.compat.v1.Session(graph=g) as sess:
            return bool(np.array_equal(sess.run(y), np.arange(6).reshape(2, 3) * 2))


def _check(path: Path) -> str:
    import tensorflow as tf
    return _self_test(Library(tf.load_op_library(str(path)), path, _align()))


def main(argv=None) -> int:
    return native_build.main(argv, "sdp.tensorflow.build_ops", "sdp's TensorFlow ops (graph collectives, their error classes)",
                             library_path, build, _check)


if __name__ == "__main__":
    sys.exit(main())

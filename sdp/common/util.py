"""Framework-free helpers with the names of ``horovod.common.util``.

Under ``sdprun --compat horovod`` the module ``horovod.common.util`` is this one, so scripts and
tests that call Horovod's helpers keep working:

- ``env(**kwargs)``: a context manager that sets environment variables (values ``None`` are left
  alone) and restores the previous values on exit.
- ``split_list(l, n)``: ``l`` cut into ``n`` contiguous chunks whose lengths differ by at most one,
  the longer ones first.
- ``is_iterable(x)``, ``num_rank_is_power_2(n)``, ``get_average_backwards_compatibility_fun``,
  ``get_ext_suffix()``, ``get_extension_full_path(pkg_path, *args)``, ``_cache(f)``.
- Build queries: sdp is pure Python over ZeroMQ and numpy, without Horovod's compiled
  extensions or MPI/Gloo/NCCL/DDL/CCL backends: ``mpi_built()``, ``gloo_built()``, ``ddl_built()``,
  ``ccl_built()`` return ``False``, ``nccl_built()`` ``0`` (Horovod's value without NCCL),
  ``gpu_available(ext)`` ``False``.  ``extension_available(ext)`` and
  ``check_extension(ext_name, ...)`` answer for sdp's faces: ``tensorflow`` (and Keras on it) is
  there when TensorFlow is installed, ``torch`` when PyTorch is; ``mxnet`` never is
  (``check_extension`` raises ``ImportError`` naming the extension).
- ``check_installed_version(name, version, exception=None)``: nothing to check (sdp has no
  binary built against a framework version); returns ``None``.
- ``is_version_greater_equal_than(ver, target)``: ``ver >= target`` as versions (PEP 440, with
  ``packaging``); ``ValueError`` unless both are strings and ``target`` is ``major.minor.patch``.

This layer imports no framework: a framework's presence is looked up with
``importlib.util.find_spec``, without importing it (``gpu_available`` asks the framework itself,
lazily, as Horovod's does).
"""
import importlib.util
import os
import sysconfig
import warnings
from contextlib import contextmanager

EXTENSIONS = ["tensorflow", "torch", "mxnet"]
_SDP_FACES = {"tensorflow": "tensorflow", "keras": "tensorflow", "tensorflow.keras": "tensorflow", "torch": "torch"}


def get_ext_suffix() -> str:
    """The file suffix of compiled Python extensions here (e.g. ``.cpython-311-x86_64-linux-gnu.so``).
    Mirrors ``horovod.common.util.get_ext_suffix``."""
    return sysconfig.get_config_var("EXT_SUFFIX") or sysconfig.get_config_var("SO") or ".so"


def get_extension_full_path(pkg_path: str, *args: str) -> str:
    """``dirname(pkg_path)/args[0]/.../args[-1]<ext suffix>``.  Raises ``ValueError`` without
    ``args``.  Mirrors ``horovod.common.util.get_extension_full_path``."""
    if not args:
        raise ValueError("get_extension_full_path(pkg_path, *args): give at least one path part")
    return os.path.join(os.path.dirname(pkg_path), *args[:-1], args[-1] + get_ext_suffix())


def _face(ext_name: str) -> str:
    """``'horovod.tensorflow'`` / ``'tensorflow'`` -> ``'tensorflow'``."""
    name = ext_name[len("horovod."):] if ext_name.startswith("horovod.") else ext_name
    return name.lstrip(".")


def extension_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether sdp provides the Horovod extension ``ext_base_name`` (``'tensorflow'``,
    ``'torch'``, ``'mxnet'``): True for TensorFlow (and Keras) when TensorFlow is installed.
    Mirrors ``horovod.common.util.extension_available``."""
    framework = _SDP_FACES.get(_face(ext_base_name))
    available = framework is not None and importlib.util.find_spec(framework) is not None
    if verbose:
        print(f"Extension {ext_base_name} {'was' if available else 'was NOT'} built.")
    return available


def check_extension(ext_name: str, ext_env_var: str, pkg_path: str, *args: str) -> None:
    """Raise ``ImportError`` unless sdp provides extension ``ext_name`` (e.g.
    ``'horovod.tensorflow'``); ``ext_env_var``, ``pkg_path`` and ``args`` (where Horovod looks
    for its compiled library) are accepted and not used.  Mirrors
    ``horovod.common.util.check_extension``."""
    if not extension_available(ext_name):
        face = _face(ext_name)
        why = (f"{_SDP_FACES[face]} is not installed" if face in _SDP_FACES
               else "sdp provides the TensorFlow and PyTorch faces only")
        raise ImportError(f"Extension {ext_name} is not available in sdp: {why}.")


def cuda_built() -> bool:
    """True when PyCUDA (the ``cuda`` extra), sdp's device path, is installed; found without
    importing it (no CUDA context is made).  Mirrors ``horovod.tensorflow.cuda_built``."""
    return importlib.util.find_spec("pycuda") is not None


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """True when sdp can reduce ``ext_base_name``'s (``'tensorflow'``, ``'torch'``) GPU tensors on
    the device: PyCUDA is installed and the framework sees a GPU.  Mirrors
    ``horovod.common.util.gpu_available``."""
    available = False
    if cuda_built() and ext_base_name.split(".")[-1] == "tensorflow":
        import tensorflow as tf
        available = bool(tf.config.list_physical_devices("GPU"))
    elif cuda_built() and ext_base_name.split(".")[-1] == "torch":
        import torch
        available = torch.cuda.is_available()
    if verbose:
        print(f"Extension {ext_base_name} {'was' if available else 'was NOT'} built with GPU support.")
    return available


def mpi_built(verbose: bool = False) -> bool:
    """False: sdp does not use MPI.  Mirrors ``horovod.common.util.mpi_built``."""
    return False


def gloo_built(verbose: bool = False) -> bool:
    """False: sdp does not use Gloo.  Mirrors ``horovod.common.util.gloo_built``."""
    return False


def nccl_built(verbose: bool = False) -> int:
    """0 (no NCCL).  Mirrors ``horovod.common.util.nccl_built``."""
    return 0


def ddl_built(verbose: bool = False) -> bool:
    """False.  Mirrors ``horovod.common.util.ddl_built``."""
    return False


def ccl_built(verbose: bool = False) -> bool:
    """False.  Mirrors ``horovod.common.util.ccl_built``."""
    return False


def _cache(f):
    """Memoize ``f`` on its (hashable) positional and keyword arguments.  Mirrors
    ``horovod.common.util._cache``."""
    cache = {}

    def wrapper(*args, **kwargs):
        key = (args, frozenset(kwargs.items()))
        if key not in cache:
            cache[key] = f(*args, **kwargs)
        return cache[key]

    wrapper.__wrapped__ = f
    wrapper.__name__ = getattr(f, "__name__", "wrapper")
    return wrapper


@contextmanager
def env(**kwargs):
    """Set environment variables for the ``with`` block (``None`` values are skipped; values must
    be strings) and restore or remove them afterwards.  Mirrors ``horovod.common.util.env``."""
    values = {k: v for k, v in kwargs.items() if v is not None}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def get_average_backwards_compatibility_fun(reduce_ops):
    """``impl(op, average)`` for the legacy ``average=`` argument: ``op`` if given (``ValueError``
    when ``average`` is given too), else ``reduce_ops.Average``/``Sum`` for ``average``
    True/False (with a ``DeprecationWarning``), else ``reduce_ops.Average``.  Mirrors
    ``horovod.common.util.get_average_backwards_compatibility_fun``."""
    def impl(op, average):
        if op is not None:
            if average is not None:
                raise ValueError("The op parameter supersedes average. Please provide only one of them.")
            return op
        if average is not None:
            warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                          DeprecationWarning, stacklevel=2)
            return reduce_ops.Average if average else reduce_ops.Sum
        return reduce_ops.Average
    return impl


def num_rank_is_power_2(num_rank: int) -> bool:
    """True if ``num_rank`` is a power of two (1, 2, 4, ...).  Mirrors
    ``horovod.common.util.num_rank_is_power_2``."""
    return num_rank != 0 and (num_rank & (num_rank - 1)) == 0


def split_list(l, n: int) -> list:  # noqa: E741 (Horovod's parameter name)
    """``l`` split into ``n`` contiguous chunks (lists), the first ``len(l) % n`` one element
    longer.  Raises ``ZeroDivisionError`` for ``n == 0``.  Mirrors ``horovod.common.util.split_list``."""
    d, r = divmod(len(l), n)
    return [l[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]


def is_iterable(x) -> bool:
    """True if ``iter(x)`` works.  Mirrors ``horovod.common.util.is_iterable``."""
    try:
        iter(x)
    except TypeError:
        return False
    return True


def check_installed_version(name: str, version: str, exception=None) -> None:
    """Nothing to check: sdp has no binary built against a framework version.  Mirrors the
    signature of ``horovod.common.util.check_installed_version``."""
    return None


@_cache
def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """True if version string ``ver`` is at least ``target`` (``"major.minor.patch"``).  Raises
    ``ValueError`` for a non-string argument or a ``target`` of another form.  Mirrors
    ``horovod.common.util.is_version_greater_equal_than``."""
    if not isinstance(ver, str) or not isinstance(target, str):
        raise ValueError(f"is_version_greater_equal_than takes two strings, got ver={ver!r} "
                         f"({type(ver).__name__}) and target={target!r} ({type(target).__name__})")
    if len(target.split(".")) != 3:
        raise ValueError(f"target must be a version of the form major.minor.patch, got {target!r}")
    from packaging.version import Version
    return Version(ver) >= Version(target)

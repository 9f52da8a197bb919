"""Drop-in import compatibility: ``horovod``, ``smdistributed`` and ``kungfu`` module names on sdp.

After ``install`` (or in the workers of ``sdprun --compat horovod,smdistributed,kungfu``)::

    import horovod.tensorflow as hvd                       # sdp.tensorflow, Horovod's init()
    import horovod.tensorflow.keras as hvd                 # sdp.tensorflow.keras, Horovod's init()
    import horovod.keras as hvd                            # the same (legacy name)
    import horovod.torch as hvd                            # is sdp.torch (Horovod's init())
    import smdistributed.dataparallel.tensorflow as sdp    # sdp.tensorflow, SMDDP's init()
    import smdistributed.dataparallel.torch.distributed    # is sdp.compat_smddp.torch.distributed
    import kungfu.python                                   # is sdp_kungfu_bridge.python
    from kungfu.tensorflow.optimizers import ...           # from sdp_kungfu_bridge.tensorflow.optimizers
    from kungfu.torch.optimizers import ...                # from sdp_kungfu_bridge.torch.optimizers

Where Horovod and SageMaker differ, the family the script imported decides
    ``init()`` called again is a no-op in plain ``sdp.tensorflow`` and under ``horovod.*``
    (Horovod's rule) and raises ``AlreadyInitializedError`` under
    ``smdistributed.*`` only (SMDDP's rule).  So ``smdistributed.dataparallel.tensorflow`` and
    ``smdistributed.dataparallel.tensorflow.keras`` are the thin modules
    ``sdp.compat_smddp.tensorflow`` / ``sdp.compat_smddp.keras``: every name in them is
    sdp.tensorflow's (or sdp.tensorflow.keras's) own object except ``init``.
    ``horovod.tensorflow`` and ``horovod.tensorflow.keras`` are ``sdp.compat_horovod.tensorflow``
    / ``sdp.compat_horovod.keras``: sdp's objects plus Horovod's process-set names.

Horovod's other module paths
    ``horovod.tensorflow.util`` / ``.mpi_ops`` / ``.functions`` / ``.compression`` / ``.elastic``
    and ``horovod.tensorflow.keras.callbacks`` are ``sdp.tensorflow.<same>``; ``horovod.common.util`` is ``sdp.common.util``,
    ``horovod.common.exceptions`` is ``sdp.common.errors``; ``horovod.runner`` (``run``,
    ``util.threads``) is ``sdp.compat_horovod.runner``.  ``horovod.torch`` and its submodules
    (``mpi_ops``, ``functions``, ``compression``, ``optimizer``, ``sync_batch_norm``, ``elastic``)
    are ``sdp.torch.<same>`` (a Horovod-only face: its ``init()`` follows Horovod's rule itself).

Mechanism
    A ``importlib.abc.MetaPathFinder`` at the front of ``sys.meta_path`` maps names to sdp
    modules.  An alias is the *same module object* (``sys.modules["horovod.tensorflow.
    elastic"] is sys.modules["sdp.tensorflow.elastic"]``), so identity and ``isinstance`` hold; every
    submodule follows its prefix (``horovod.tensorflow.X`` -> ``sdp.tensorflow.X``) unless the
    family names that exact module (``_Family.exact``, e.g. ``horovod.tensorflow`` itself).
    Targets are imported lazily, when the alias is imported: a missing target (e.g. a bridge
    module not written yet) gives a ``ModuleNotFoundError`` naming both the alias and the missing
    sdp module.  The
    top-level packages (``horovod``, ``smdistributed``, ``smdistributed.dataparallel``,
    ``kungfu``) are small synthetic packages; ``horovod.run`` is ``run``.

    ``sdprun --compat X`` exports ``SDP_COMPAT=X`` and puts ``SHIM_DIR`` (``sdp/_compat_site``)
    first on the workers' ``PYTHONPATH``.  That directory holds tiny real packages ``horovod/``,
    ``smdistributed/`` and ``kungfu/`` whose ``__init__`` calls ``_activate_shim``, which
    installs the finder for that family (only if ``SDP_COMPAT`` names it).  No ``sitecustomize``
    or ``.pth`` file is involved, and nothing happens until the script imports one of these names.

    MindSpore (``--compat kungfu``): the KungFu fork's modules ``mindspore.ops.operations.
    kungfu_comm_ops``, ``mindspore.nn.optim.kungfu`` and ``mindspore.train.callback._kungfu`` are
    ``sdp_kungfu_bridge.mindspore.{ops,optim,callback}`` (``_Family.guarded``: mapped inside the
    real, unmodified MindSpore, each only while MindSpore has no module of that name: a KungFu-built
    MindSpore is used as it is, with a ``CompatShadowWarning``).  The shim ``mindspore/`` package
    loads the real MindSpore in its place (``_activate_shim``) and then itself adds the fork's
    ``mindspore._c_expression.kungfu_*`` functions
    (``sdp_kungfu_bridge.mindspore.add_c_expression_functions``), so this module never imports
    the bridge (which imports it).

Never shadowing a real installation silently
    Before mapping a family, the real package is looked up with sdp's finder and ``SHIM_DIR`` left
    out (``sys.modules``, then every other ``sys.meta_path`` finder, without importing it).  If a
    real ``horovod`` / ``smdistributed.dataparallel`` / ``kungfu`` exists, sdp does *not* replace
    it and warns (``CompatShadowWarning``) with its location and how to choose:
    ``SDP_COMPAT_FORCE=1`` (or a comma list of families) or ``install(force=True)`` uses sdp
    anyway.  Under ``sdprun --compat`` the shim package then loads the real package in its place.

Keras 3 optimizers
    Horovod/SageMaker scripts call ``hvd.broadcast_variables(opt.variables(), root_rank=0)``; in
    Keras 3 ``Optimizer.variables`` is a property returning a list.  ``import sdp.tensorflow``
    (and so every alias of it) patches that property to return a list subclass that is also
    callable (calling it returns the list itself), so both spellings work, with or without
    ``--compat`` (``sdp.tensorflow.keras_variables``).
"""
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import threading
import types
import warnings
from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple, Union

log = logging.getLogger("sdp.compat")

from sdp.common.compat_names import COMPAT_ENV, FAMILIES, FORCE_ENV, SHIM_DIR, parse_families  # noqa: F401

_TRUE = ("1", "true", "yes", "on", "all")


class CompatShadowWarning(UserWarning):
    """A real horovod/smdistributed/kungfu installation was found (and is, or is not, replaced)."""


class _Family(NamedTuple):
    packages: Tuple[str, ...]   # synthetic packages, outermost first; the last one is the guard
    aliases: Tuple[Tuple[str, str], ...]  # (alias prefix, sdp module): the name and its submodules
    dists: Tuple[str, ...]      # distribution names of the real thing (for messages)
    exact: Tuple[Tuple[str, str], ...] = ()  # (alias, sdp module): that name only, before aliases
    # (alias, sdp module): that name only, inside a real package (MindSpore); each is mapped only
    # while no real module of that name exists (checked when it is imported)
    guarded: Tuple[Tuple[str, str], ...] = ()


_FAMILY_DEFS: Dict[str, _Family] = {
    "horovod": _Family(
        packages=("horovod",),
        aliases=(("horovod.tensorflow", "sdp.tensorflow"), ("horovod.keras", "sdp.tensorflow.keras"),
                 ("horovod.torch", "sdp.torch"), ("horovod.common", "sdp.common"),
                 ("horovod.runner", "sdp.compat_horovod.runner"), ("horovod.ray", "sdp.ray")),
        dists=("horovod",),
        # sdp.tensorflow and sdp.tensorflow.keras plus Horovod's low-level names (process sets,
        # mpi_ops); their submodules still follow the aliases.
        exact=(("horovod.tensorflow", "sdp.compat_horovod.tensorflow"),
               ("horovod.tensorflow.keras", "sdp.compat_horovod.keras"),
               ("horovod.keras", "sdp.compat_horovod.keras"),
               ("horovod.common.exceptions", "sdp.common.errors"),
               ("horovod.common.process_sets", "sdp.process_sets"))),
    "smdistributed": _Family(
        packages=("smdistributed", "smdistributed.dataparallel"),
        aliases=(("smdistributed.dataparallel.tensorflow", "sdp.tensorflow"),
                 ("smdistributed.dataparallel.torch", "sdp.compat_smddp.torch")),
        dists=("smdistributed-dataparallel", "smdistributed_dataparallel"),
        # SMDDP's init() raises when called again (sdp's and Horovod's return): these two modules
        # are sdp.tensorflow and sdp.tensorflow.keras with that init
        exact=(("smdistributed.dataparallel.tensorflow", "sdp.compat_smddp.tensorflow"),
               ("smdistributed.dataparallel.tensorflow.keras", "sdp.compat_smddp.keras"))),
    "kungfu": _Family(
        packages=("kungfu",),
        aliases=(("kungfu.python", "sdp_kungfu_bridge.python"),
                 ("kungfu.tensorflow", "sdp_kungfu_bridge.tensorflow"),
                 ("kungfu.torch", "sdp_kungfu_bridge.torch"),
                 ("kungfu.datasets", "sdp_kungfu_bridge.datasets")),
        dists=("kungfu",),
        # the KungFu fork of MindSpore (sdp_kungfu_bridge.mindspore); the real MindSpore stays
        guarded=(("mindspore.ops.operations.kungfu_comm_ops", "sdp_kungfu_bridge.mindspore.ops"),
                 ("mindspore.nn.optim.kungfu", "sdp_kungfu_bridge.mindspore.optim"),
                 ("mindspore.train.callback._kungfu", "sdp_kungfu_bridge.mindspore.callback"))),
}

_PACKAGE_DOCS = {
    "horovod": "horovod on sdp (sdp.compat): horovod.tensorflow and horovod.tensorflow.keras "
               "are sdp.tensorflow and sdp.tensorflow.keras with Horovod's process sets (see "
               "sdp.compat_horovod); horovod.torch is sdp.torch; horovod.run starts the ranks of a "
               "function.",
    "smdistributed": "smdistributed on sdp (sdp.compat).",
    "smdistributed.dataparallel": "smdistributed.dataparallel on sdp (sdp.compat): "
                                  "smdistributed.dataparallel.tensorflow is sdp.tensorflow with "
                                  "SMDDP's init() (see sdp.compat_smddp); "
                                  "smdistributed.dataparallel.torch is sdp.compat_smddp.torch.",
    "kungfu": "kungfu on sdp (sdp.compat): kungfu.python, kungfu.tensorflow and kungfu.torch are "
              "sdp_kungfu_bridge.python, sdp_kungfu_bridge.tensorflow and sdp_kungfu_bridge.torch; the KungFu fork's "
              "MindSpore modules are sdp_kungfu_bridge.mindspore.",
}


def _forced_from_env() -> Tuple[str, ...]:
    value = os.environ.get(FORCE_ENV, "").strip().lower()
    if not value or value in ("0", "false", "no", "off"):
        return ()
    if value in _TRUE:
        return FAMILIES
    try:
        return parse_families(value)
    except ValueError:
        return FAMILIES


def _forced(force: Union[bool, str, Iterable[str], None]) -> Tuple[str, ...]:
    if force is None:
        return _forced_from_env()
    if force is True:
        return FAMILIES
    if force is False:
        return ()
    return parse_families(force)


# ---------------------------------------------------------------- finding a real installation

def _is_ours(module) -> bool:
    """Whether ``module`` is sdp's (an sdp module, a synthetic package, or a shim package)."""
    if getattr(module, "__sdp_compat__", None):
        return True
    name = getattr(module, "__name__", "") or ""
    if name == "sdp" or name.startswith(("sdp.", "sdp_kungfu_bridge")):
        return True
    origin = getattr(module, "__file__", None)
    if origin:
        shim = os.path.normcase(os.path.realpath(SHIM_DIR)) + os.sep
        return os.path.normcase(os.path.realpath(origin)).startswith(shim)
    return False


def _without_shim(paths: Optional[Iterable[str]]) -> List[str]:
    shim = os.path.normcase(os.path.realpath(SHIM_DIR))
    out = []
    for p in paths or ():
        try:
            if os.path.normcase(os.path.realpath(p or os.getcwd())) == shim:
                continue
        except (TypeError, ValueError, OSError):
            pass
        out.append(p)
    return out


def _find_other(name: str, path: Optional[List[str]]):
    """The spec of ``name`` from every meta-path finder except sdp's, ignoring ``SHIM_DIR``."""
    search = _without_shim(sys.path if path is None else path)
    for finder in sys.meta_path:
        if isinstance(finder, _CompatFinder):
            continue
        try:
            if finder is importlib.machinery.PathFinder:
                spec = finder.find_spec(name, search)
            else:
                find = getattr(finder, "find_spec", None)
                if find is None:
                    continue
                spec = find(name, None if path is None else search)
        except (ImportError, AttributeError, TypeError, ValueError):
            continue
        if spec is not None:
            return spec
    return None


def _is_namespace(spec) -> bool:
    return spec.origin in (None, "namespace") and spec.submodule_search_locations is not None \
        and not getattr(spec, "has_location", False)


def find_real(name: str):
    """The ``ModuleSpec`` of a real (non-sdp) installation of dotted ``name``, or ``None``.

    Looks in ``sys.modules`` first, then asks the import system's finders without importing
    anything; sdp's own finder and shim directory are left out."""
    parts = name.split(".")
    path = None
    spec = None
    for i in range(len(parts)):
        sub = ".".join(parts[:i + 1])
        mod = sys.modules.get(sub)
        if mod is not None and not _is_ours(mod):
            spec = getattr(mod, "__spec__", None)
            locations = getattr(mod, "__path__", None)
            if spec is None:
                spec = importlib.machinery.ModuleSpec(sub, None, origin=getattr(mod, "__file__", None),
                                                      is_package=locations is not None)
        else:
            spec = _find_other(sub, path)
            if spec is None:
                return None
            locations = spec.submodule_search_locations
        if i < len(parts) - 1:
            if locations is None:
                return None
            path = list(locations)
    return spec


def _describe(spec) -> str:
    if spec.origin and spec.origin not in ("namespace", "built-in", "frozen"):
        return spec.origin
    locations = list(spec.submodule_search_locations or ())
    return ", ".join(locations) if locations else "(unknown location)"


def _dist_note(family: str) -> str:
    try:
        from importlib import metadata
    except ImportError:  # pragma: no cover
        return ""
    for dist in _FAMILY_DEFS[family].dists:
        try:
            return f" (distribution {dist} {metadata.version(dist)})"
        except Exception:  # PackageNotFoundError, broken metadata
            continue
    return ""


def _real_guard(family: str):
    """The spec of a real installation that sdp must not shadow for ``family``, or ``None``.

    Namespace packages (a bare directory named e.g. ``horovod`` somewhere on ``sys.path``) do
    not count as an installation."""
    spec = find_real(_FAMILY_DEFS[family].packages[-1])
    if spec is None or _is_namespace(spec):
        return None
    return spec


# ---------------------------------------------------------------- the finder

class _CompatFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Maps compatibility names to sdp modules (see the module docstring)."""

    def __init__(self):
        self.families: Dict[str, bool] = {}     # active family -> forced
        self.packages: Dict[str, str] = {}      # synthetic package -> family
        self.aliases: Dict[str, Tuple[str, str]] = {}  # alias prefix -> (target, family)
        self.exact: Dict[str, Tuple[str, str]] = {}    # alias (that name only) -> (target, family)
        self.guarded: Dict[str, Tuple[str, str]] = {}  # alias in a real package -> (target, family)

    def map(self, fullname: str) -> Optional[Tuple[str, str]]:
        """``(sdp module, family)`` that ``fullname`` aliases, or ``None``: an exact alias first,
        else the longest alias prefix (``horovod.tensorflow.X`` -> ``sdp.tensorflow.X``)."""
        if fullname in self.exact:
            return self.exact[fullname]
        if fullname in self.guarded:
            target, family = self.guarded[fullname]
            if not self.families.get(family) and find_real(fullname) is not None:
                warnings.warn(
                    f"sdp.compat: a real {fullname!r} was found (a KungFu-built MindSpore); sdp is NOT "
                    f"replacing it. To use sdp instead, set {FORCE_ENV}=1 (or {FORCE_ENV}={family}).",
                    CompatShadowWarning, stacklevel=3)
                return None
            return target, family
        best = None
        for prefix, (target, family) in self.aliases.items():
            if fullname == prefix or fullname.startswith(prefix + "."):
                if best is None or len(prefix) > len(best[0]):
                    best = (prefix, target, family)
        if best is None:
            return None
        prefix, target, family = best
        return target + fullname[len(prefix):], family

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.packages:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        mapped = self.map(fullname)
        if mapped is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, loader_state=mapped)

    def create_module(self, spec):
        if spec.name in self.packages:
            module = types.ModuleType(spec.name)
            _populate_package(module, spec.name, self.packages[spec.name])
            return module
        target, family = spec.loader_state
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            missing = e.name or ""
            if missing and (target == missing or target.startswith(missing + ".")):
                raise ModuleNotFoundError(
                    f"No module named {spec.name!r}: sdp's {family} compatibility maps it to "
                    f"{target!r}, but {missing!r} does not exist in this sdp installation",
                    name=spec.name) from e
            raise
        # module_from_spec() overwrites __spec__ with the alias spec; exec_module() puts it back.
        spec.loader_state = (target, family, module.__spec__)
        return module

    def exec_module(self, module):
        state = module.__spec__.loader_state if module.__spec__ is not None else None
        if not state or len(state) != 3:
            return  # a synthetic package: nothing to run
        target, family, real_spec = state
        try:
            module.__spec__ = real_spec
        except AttributeError:  # pragma: no cover
            pass
        if family in ("horovod", "smdistributed") and _under(target, _TF_FACES):
            from sdp.tensorflow.keras_variables import patch_keras_optimizer_variables
            patch_keras_optimizer_variables()


def _populate_package(module, name: str, family: str) -> None:
    """Give a synthetic (or shim) package its attributes."""
    import sdp
    module.__doc__ = _PACKAGE_DOCS.get(name, module.__doc__)
    module.__sdp_compat__ = family
    module.__version__ = sdp.__version__
    if getattr(module, "__path__", None) is None:
        module.__path__ = []
    if name == "horovod":
        module.run = run
    elif name == "kungfu":  # KungFu's own examples do `from kungfu import current_rank`
        module.__getattr__ = lambda attr: getattr(importlib.import_module("sdp_kungfu_bridge"), attr)


_TF_FACES = ("sdp.tensorflow", "sdp.compat_horovod.tensorflow", "sdp.compat_horovod.keras", "sdp.compat_smddp")
_lock = threading.RLock()
_finder: Optional[_CompatFinder] = None


def _the_finder(create: bool) -> Optional[_CompatFinder]:
    global _finder
    if _finder is None and create:
        _finder = _CompatFinder()
    if _finder is not None and create and _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    return _finder


def _family_names(family: str) -> List[str]:
    d = _FAMILY_DEFS[family]
    return list(d.packages) + [a for a, _ in d.aliases] + [a for a, _ in d.exact] + [a for a, _ in d.guarded]


def _under(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def installed() -> Tuple[str, ...]:
    """The families whose names currently resolve to sdp."""
    f = _finder
    if f is None or f not in sys.meta_path:
        return ()
    return tuple(x for x in FAMILIES if x in f.families)


def install(which: Union[str, Iterable[str]] = FAMILIES,
            force: Union[bool, str, Iterable[str], None] = None) -> Tuple[str, ...]:
    """Make ``which`` (family names or a comma list: horovod, smdistributed, kungfu) import as sdp.

    ``force``: ``None`` reads ``SDP_COMPAT_FORCE`` (``1`` / ``all`` or a comma list of families);
    ``True`` or a list of families replaces a real installation of those families.  Without it,
    a family with a real installation is left alone and a ``CompatShadowWarning`` says so.
    With it, the real installation is replaced (with a warning), and any of its modules already
    imported are dropped from ``sys.modules`` so that the next import gives sdp.

    Idempotent.  Returns the families now mapped to sdp."""
    families = parse_families(which)
    forced = _forced(force)
    with _lock:
        finder = _the_finder(create=False)
        for family in families:
            if finder is not None and family in finder.families and finder in sys.meta_path:
                continue
            real = _real_guard(family)
            fam_forced = family in forced
            if real is not None:
                where = _describe(real) + _dist_note(family)
                guard = _FAMILY_DEFS[family].packages[-1]
                if not fam_forced:
                    warnings.warn(
                        f"sdp.compat: a real {guard!r} installation was found at {where}; sdp is NOT "
                        f"replacing it, so 'import {guard}...' uses that installation. To use sdp "
                        f"instead, set {FORCE_ENV}=1 (or {FORCE_ENV}={family}) or call "
                        f"sdp.compat.install(force=True); to silence this, drop '{family}' from "
                        f"--compat / install().", CompatShadowWarning, stacklevel=2)
                    continue
                warnings.warn(
                    f"sdp.compat: a real {guard!r} installation was found at {where}; it is being "
                    f"replaced by sdp because {FORCE_ENV} / install(force=...) asks for it.",
                    CompatShadowWarning, stacklevel=2)
            finder = _the_finder(create=True)
            definition = _FAMILY_DEFS[family]
            for pkg in definition.packages:
                # Keep a real parent package that lacks our part (e.g. smdistributed.modelparallel
                # alone): submodules are still intercepted by the finder in front of it.
                existing = find_real(pkg)
                if fam_forced or existing is None or _is_namespace(existing) and pkg == definition.packages[-1]:
                    finder.packages[pkg] = family
            for alias, target in definition.aliases:
                finder.aliases[alias] = (target, family)
            for alias, target in definition.exact:
                finder.exact[alias] = (target, family)
            for alias, target in definition.guarded:
                finder.guarded[alias] = (target, family)
            finder.families[family] = fam_forced
            if fam_forced:
                prefixes = _family_names(family)
                for name in [n for n in sys.modules if _under(n, prefixes)]:
                    if not _is_ours(sys.modules[name]):
                        del sys.modules[name]
            log.debug("compat: %s -> sdp%s", family, " (forced)" if fam_forced else "")
    return installed()


def uninstall(which: Union[str, Iterable[str]] = FAMILIES) -> None:
    """Undo ``install`` for ``which``: the names stop resolving to sdp, and the aliases
    already in ``sys.modules`` are removed (modules holding references keep them).  The Keras
    patch stays."""
    families = parse_families(which)
    with _lock:
        finder = _finder
        if finder is None:
            return
        for family in families:
            if finder.families.pop(family, None) is None:
                continue
            for pkg in [p for p, f in finder.packages.items() if f == family]:
                del finder.packages[pkg]
            for alias in [a for a, (_, f) in finder.aliases.items() if f == family]:
                del finder.aliases[alias]
            for alias in [a for a, (_, f) in finder.exact.items() if f == family]:
                del finder.exact[alias]
            for alias in [a for a, (_, f) in finder.guarded.items() if f == family]:
                del finder.guarded[alias]
            prefixes = _family_names(family)
            for name in [n for n in sys.modules if _under(n, prefixes)]:
                if _is_ours(sys.modules[name]):
                    del sys.modules[name]
        if not finder.families and finder in sys.meta_path:
            sys.meta_path.remove(finder)


# ---------------------------------------------------------------- sdprun --compat shim packages

def _activate_shim(name: str) -> None:
    """Called by ``sdp/_compat_site/<name>/__init__.py`` while it is imported as ``name``.

    If ``SDP_COMPAT`` enables the family and no real installation exists (or ``SDP_COMPAT_FORCE``
    says to replace it), the shim becomes the synthetic package and the finder handles the
    submodules.  Otherwise the real package (if any) is loaded in the shim's place, or the import
    fails as if the shim were not there."""
    module = sys.modules[name]
    family = _SHIM_FAMILY.get(name, name)
    try:
        enabled = parse_families(os.environ.get(COMPAT_ENV, ""))
    except ValueError as e:
        warnings.warn(f"sdp.compat: ignoring {COMPAT_ENV}: {e}", CompatShadowWarning, stacklevel=3)
        enabled = ()
    if family in enabled:
        install((family,))
    finder = _finder
    if finder is not None and finder.packages.get(name) == name and name in installed():
        _populate_package(module, name, name)
        module.__path__ = []  # submodules come from the finder, never from the shim directory
        return
    real = find_real(name)
    if real is None or real.loader is None:
        why = (f"{COMPAT_ENV}={os.environ.get(COMPAT_ENV, '')!r} does not enable it"
               if family not in enabled else "sdp did not take it over")
        raise ModuleNotFoundError(f"No module named {name!r} (sdp's import shim for it is on "
                                  f"PYTHONPATH, but {why})", name=name)
    real_module = importlib.util.module_from_spec(real)
    sys.modules[name] = real_module  # the import system returns sys.modules[name] after __init__
    try:
        real.loader.exec_module(real_module)
    except BaseException:
        sys.modules.pop(name, None)
        raise


#: Shim packages of a real framework (loaded in the shim's place) that a family adds names to.
_SHIM_FAMILY = {"mindspore": "kungfu"}


# ---------------------------------------------------------------- horovod.run

def run(fn, args=(), kwargs=None, np: int = 1, hosts: Optional[str] = None, **kw):
    """``horovod.run``: call ``fn(*args, **kwargs)`` on ``np`` ranks (local, or on ``hosts``
    through ssh) and return their results in rank order.  An alias of
    ``sdp.launcher.run_func.run``, which documents the keywords and what must be picklable."""
    from sdp.launcher.run_func import run as launcher_run
    active = installed()
    forced = [f for f in active if _finder is not None and _finder.families.get(f)]
    return launcher_run(fn, args, kwargs, np=np, hosts=hosts, compat=active, compat_forced=forced, **kw)

"""MkDocs hook (mkdocs.yml ``hooks:``): every ``::: module`` line of a page that has no options of
its own gets ``members:`` listing the module's public names, so that the API reference shows the
names a face re-exports from other modules too (mkdocstrings renders imported names only when
they are listed, or in ``__all__``).

Public names: ``__all__`` plus every attribute without a leading underscore that is not a module
(the faces' implementation modules are documented through the names they export) or a logger."""
import importlib
import inspect
import logging
import re

_DIRECTIVE = re.compile(r"^::: ([A-Za-z_][\w.]*)\s*$")
_NOT_API = {"tf", "keras", "np"}  # modules a face imports for itself


def public_names(module) -> list:
    """The names ``module`` offers its users, sorted."""
    names = set(getattr(module, "__all__", ()))
    names |= {n for n, v in vars(module).items()
              if not n.startswith("_") and not inspect.ismodule(v) and not isinstance(v, logging.Logger)}
    return sorted(names - _NOT_API)


def expand(markdown: str) -> str:
    """``markdown`` with a ``members:`` option under every bare ``::: module`` line."""
    lines = markdown.splitlines()
    out = []
    for i, line in enumerate(lines):
        out.append(line)
        m = _DIRECTIVE.match(line)
        has_options = i + 1 < len(lines) and lines[i + 1].startswith("    ")
        if m and not has_options:
            module = importlib.import_module(m.group(1))
            if inspect.ismodule(module):
                out += ["    options:", "      members: [" + ", ".join(public_names(module)) + "]"]
    return "\n".join(out) + "\n"


def on_page_markdown(markdown, **kwargs):
    return expand(markdown)

"""The import graph of ``sdp`` and ``sdp_kungfu_bridge`` (grimp, import-linter's graph builder;
imports inside functions count, and so do ``importlib.import_module("literal")`` calls): no module
reaches itself through imports, the launcher never imports the faces, and no arrow points up from a
framework face to :mod:`sdp.compat` (the layer above the faces).  And no source file is over 800
lines (issue 55: split along responsibilities instead)."""
import ast
import pathlib

import pytest

grimp = pytest.importorskip("grimp")

#: known circles, to be broken (none left)
KNOWN = []


def _circles(graph):
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.add(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("sdp", "sdp_kungfu_bridge")


def _graph():
    """grimp's graph of both packages, plus an edge for each ``import_module("<one of them>...")``
    with a literal name (grimp sees only import statements)."""
    graph = grimp.build_graph(*PACKAGES)
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            importer = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
                        == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
                        and isinstance(node.args[0].value, str)
                        and node.args[0].value.split(".")[0] in PACKAGES
                        and node.args[0].value in graph.modules and importer in graph.modules):
                    graph.add_import(importer=importer, imported=node.args[0].value)
    return graph


def test_no_import_circle_in_sdp():
    graph = _graph()
    circles = [c for c in _circles(graph) if c not in KNOWN]
    assert not circles, "import circles: " + "; ".join(" <-> ".join(sorted(c)) for c in circles)


def test_framework_faces_do_not_import_compat():
    graph = _graph()
    for face in ("sdp.tensorflow", "sdp.torch"):
        for mod in sorted(m for m in graph.modules if m == face or m.startswith(face + ".")):
            chain = graph.find_shortest_chain(importer=mod, imported="sdp.compat")
            assert chain is None, f"{mod} imports sdp.compat: {' -> '.join(chain)}"


def test_launcher_does_not_import_the_faces():
    graph = _graph()
    for face in ("sdp.compat", "sdp.tensorflow", "sdp.torch", "sdp.compat_horovod", "sdp.compat_smddp"):
        for mod in sorted(m for m in graph.modules if m.startswith("sdp.launcher")):
            chain = graph.find_shortest_chain(importer=mod, imported=face)
            assert chain is None, f"{mod} imports {face}: {' -> '.join(chain)}"


def test_engine_and_api_import_no_framework():
    """The engine, transport, common and sdp.api never import TensorFlow or torch (the faces do;
    ``sdp.common.util``, Horovod's ``horovod.common.util``, asks them about GPUs, lazily)."""
    graph = grimp.build_graph("sdp", include_external_packages=True)
    below = sorted(m for m in graph.modules if m == "sdp.api" or m.split(".")[:2] in
                   (["sdp", "engine"], ["sdp", "transport"], ["sdp", "common"]))
    for framework in ("tensorflow", "torch"):
        if framework not in graph.modules:
            continue
        for mod in below:
            if mod == "sdp.common.util":
                continue
            chain = graph.find_shortest_chain(importer=mod, imported=framework)
            assert chain is None, f"{mod} imports {framework}: {' -> '.join(chain)}"


MAX_LINES = 800  # per source file (issue 55)


def test_no_source_file_is_over_800_lines():
    root = pathlib.Path(__file__).resolve().parents[1]
    over = {}
    for top in ("sdp", "sdp_kungfu_bridge", "benchmarks", "examples", "tests"):
        for path in sorted((root / top).rglob("*")):
            if path.suffix in (".py", ".c", ".h", ".cc") and path.is_file():
                lines = path.read_text(errors="replace").count("\n")
                if lines > MAX_LINES:
                    over[str(path.relative_to(root))] = lines
    assert not over, over

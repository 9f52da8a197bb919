"""The import graph of ``sdp`` (grimp, import-linter's graph builder; imports inside functions
count): no module reaches itself through imports, and the launcher never imports the faces."""
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


def test_no_import_circle_in_sdp():
    graph = grimp.build_graph("sdp")
    circles = [c for c in _circles(graph) if c not in KNOWN]
    assert not circles, "import circles: " + "; ".join(" <-> ".join(sorted(c)) for c in circles)


def test_launcher_does_not_import_the_faces():
    graph = grimp.build_graph("sdp")
    for face in ("sdp.compat", "sdp.tensorflow", "sdp.torch", "sdp.compat_horovod", "sdp.compat_smddp"):
        for mod in sorted(m for m in graph.modules if m.startswith("sdp.launcher")):
            chain = graph.find_shortest_chain(importer=mod, imported=face)
            assert chain is None, f"{mod} imports {face}: {' -> '.join(chain)}"

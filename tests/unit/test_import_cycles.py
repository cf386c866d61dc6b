"""No import cycles among pearlctl's modules, type-only imports included.

Two modules that import each other, directly or through others, cannot be understood or tested apart: to read
either one must read both, and a change to either may break the other. That holds for an import made only for
type hints (under ``if TYPE_CHECKING:``) as much as for one that runs, since the hint still says one module
needs the other's class. Where a part needs something of the module that owns it, it names what it uses in a
protocol of its own module (pearlctl/sim/routing.py, ``RoutedEngine``) or is handed it; where a module mixes a
low piece others use with a high one that uses them, the low piece lives in a module of its own
(pearlctl/router/control_loop.py).

The graph is grimp's (the library import-linter builds its contracts on), with the imports made inside
functions and under ``TYPE_CHECKING``. A cycle is a strongly connected component of more than one module; the
failure names each cycle's modules and one loop through them, each import with its file and line.
"""

from __future__ import annotations

from collections import deque

import grimp

PACKAGE = "pearlctl"


def direct_imports(graph: grimp.ImportGraph) -> dict[str, set[str]]:
    """Each pearlctl module and the pearlctl modules it imports directly (at any level, type-only included)."""
    return {m: set(graph.find_modules_directly_imported_by(m)) & graph.modules for m in graph.modules}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` (Tarjan's algorithm, without recursion), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def loop_through(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest loop from the component's first module back to it, inside the component."""
    start, inside = component[0], set(component)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node] & inside):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if nxt not in came_from:
                came_from[nxt] = node
                queue.append(nxt)
    return [start]  # (not reached: every module of a component of two or more lies on a loop)


def describe(graph: dict[str, set[str]], component: list[str], details) -> str:
    """One cycle in words: its modules, and each import of one loop through them with its line."""
    loop = loop_through(graph, component)
    lines = [f"{len(component)} modules: {', '.join(component)}", "  one loop through them:"]
    for importer, imported in zip(loop, loop[1:], strict=False):
        found = details(importer=importer, imported=imported)
        where = "; ".join(f"line {d['line_number']}: {d['line_contents']}" for d in found) or "(imported)"
        lines.append(f"    {importer} -> {imported}  ({where})")
    return "\n".join(lines)


def test_the_toy_graph_finds_its_cycles():
    # the SCC finder itself, on a graph whose cycles are known: a <-> b, c -> d -> e -> c, f alone, e -> f
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c", "f"}, "f": set()}
    cycles = sorted(c for c in strongly_connected(graph) if len(c) > 1)
    assert cycles == [["a", "b"], ["c", "d", "e"]]
    assert loop_through(graph, ["c", "d", "e"]) == ["c", "d", "e", "c"]


def test_pearlctl_has_no_import_cycles():
    built = grimp.build_graph(PACKAGE, cache_dir=None)
    graph = direct_imports(built)
    assert len(graph) > 100, "grimp found too few pearlctl modules to judge"
    cycles = [c for c in strongly_connected(graph) if len(c) > 1]
    if cycles:
        found = "\n".join(describe(graph, c, built.get_import_details) for c in cycles)
        raise AssertionError(
            f"{len(cycles)} import cycle(s) among pearlctl's modules (type-only imports count):\n{found}"
        )

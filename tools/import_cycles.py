"""No import cycle among msmon's modules, function-level imports included (`make lint`).

import-linter's contracts (.importlinter) check the layers; a cycle inside one layer, or one
that only a function-level import closes, would pass them. This walks every import grimp finds
in msmon (those under `if TYPE_CHECKING:` included: a circle that only annotations close is
still a circle to a reader) and prints each strongly connected set of two or more modules,
with one cycle through it; exit status 1 when any.
"""

from __future__ import annotations

import sys

import grimp


def import_graph(package: str) -> dict[str, set[str]]:
    """{module: the modules of `package` it imports}."""
    graph = grimp.build_graph(package, exclude_type_checking_imports=False)
    modules = sorted(m for m in graph.modules if m == package or m.startswith(package + "."))
    inside = set(modules)
    return {m: {n for n in graph.find_modules_directly_imported_by(m) if n in inside} for m in modules}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of two or more modules (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))
    return found


def one_cycle(edges: dict[str, set[str]], members: list[str]) -> list[str]:
    """A path from the first member back to itself inside `members` (breadth first)."""
    inside, start = set(members), members[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(edges[node] & inside):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in parents:
                    parents[child] = node
                    following.append(child)
        frontier = following
    return members


def main(package: str = "msmon") -> int:
    edges = import_graph(package)
    found = cycles(edges)
    for members in found:
        print(f"import cycle among {len(members)} modules: {' -> '.join(one_cycle(edges, members))}")
    if not found:
        print(f"no import cycle among {len(edges)} modules of {package}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

"""Print every import cycle among mpnb's modules; exit 1 if there is one.

Every import counts, inside functions too, since an import deferred into a function still
ties the two modules together; only those under ``if TYPE_CHECKING:`` are left out.
``--module-level`` counts only the imports that run when a module is imported (module
level, a module-level ``try`` or ``if``, class bodies).
An edge goes to the module that is named (``from a.b import c`` goes to ``a.b.c`` when that
is a module, else to ``a.b``); a parent package's ``__init__`` is not counted as imported.

Run from the checkout::

    python scripts/import_cycles.py                 # one line per cycle, exit 1 if any
    python scripts/import_cycles.py --module-level  # import-time edges only
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "mpnb"


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Map each dotted module name under ``package`` to its source file."""
    files = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
    return name == "TYPE_CHECKING"


def _import_nodes(body: list[ast.stmt], module_level: bool):
    """Yield the import statements in ``body``, skipping ``if TYPE_CHECKING:`` blocks."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _import_nodes(node.body, module_level)
            yield from _import_nodes(node.orelse, module_level)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if not module_level:
                yield from _import_nodes(node.body, module_level)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                for child in getattr(node, field, None) or ():
                    if isinstance(child, ast.stmt):
                        yield from _import_nodes([child], module_level)
                    else:  # an except handler or a match case holds statements
                        yield from _import_nodes(child.body, module_level)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    keep = len(base) - node.level + (1 if is_package else 0)
    return ".".join(base[:keep] + ([node.module] if node.module else []))


def import_graph(files: dict[str, Path], module_level: bool = False) -> dict[str, set[str]]:
    """Edges ``module -> modules it imports``, within ``files``."""
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in _import_nodes(tree.body, module_level):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                source = _resolve(name, is_package, node)
                targets = [
                    f"{source}.{a.name}" if f"{source}.{a.name}" in files else source
                    for a in node.names
                ]
            graph[name].update(t for t in targets if t in files and t != name)
    return graph


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _shortest_cycle(graph: dict[str, set[str]], members: list[str]) -> list[str]:
    """One shortest cycle through the first module of a component (breadth first)."""
    inside = set(members)
    start = members[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & inside):
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


def cycles(
    root: Path = ROOT, package: str = PACKAGE, module_level: bool = False
) -> list[list[str]]:
    """One shortest cycle (first module repeated at the end) per tangle of modules."""
    graph = import_graph(module_files(root, package), module_level)
    return [_shortest_cycle(graph, members) for members in _components(graph)]


def main(argv: list[str] | None = None) -> int:
    """Print each cycle on one line; return 1 if there is any, else 0."""
    args = sys.argv[1:] if argv is None else argv
    unknown = [a for a in args if a != "--module-level"]
    if unknown:
        print(f"unknown argument(s) {unknown}; the only option is --module-level", file=sys.stderr)
        return 2
    found = cycles(module_level="--module-level" in args)
    for cycle in found:
        print(" -> ".join(cycle))
    print(f"{len(found)} import cycle(s) in {PACKAGE}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

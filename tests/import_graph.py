"""The import graph of a Python package read from its source (ast, no imports run): edges, cycles, layers.

Used by tests/test_import_graph.py, and runnable to print a tree's figures:
`python tests/import_graph.py src/specdec` (modules per package, largest files, cycles, function-local imports).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Import:
    """One imported module: who imports it, where, and whether inside a function (local) or lazily by name."""

    importer: str
    target: str  # a dotted module name (inside the package: one of its modules; else the top-level name)
    line: int
    local: bool  # inside a function or method
    by_name: bool = False  # importlib.import_module("...") with a literal name


def package_modules(root: Path) -> dict[str, Path]:
    """Every module under the package folder `root`, by dotted name (a package by its own name)."""
    root = root.resolve()
    base = root.name
    found: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join([base, *parts])] = path
    return found


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    parts = importer.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([module] if module else []))


def _inside(known: dict[str, Path], name: str) -> str | None:
    """The longest known module that `name` is or lies in."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def read_imports(root: Path) -> list[Import]:
    """Every import statement of every module under root, resolved to modules of the package where it is one."""
    known = package_modules(root)
    found: list[Import] = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        for node, local in _walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    found.append(_make(known, name, alias.name, node.lineno, local))
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.level, node.module)
                for alias in node.names:
                    # `from . import x` / `from .pkg import sub`: a submodule when one is named so
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                    found.append(_make(known, name, target, node.lineno, local))
            elif isinstance(node, ast.Call) and _is_import_module(node):
                literal = node.args[0] if node.args else None
                if isinstance(literal, ast.Constant) and isinstance(literal.value, str):
                    found.append(_make(known, name, literal.value, node.lineno, local, by_name=True))
        # A table of lazily imported module names (PEP 562 __getattr__, subcommand dispatch): every string
        # constant that spells a dotted module name of this package, in a module that calls import_module.
        if any(isinstance(n, ast.Call) and _is_import_module(n) for n in ast.walk(tree)):
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value \
                        and node.value in known and node.value != name:
                    found.append(Import(name, node.value, node.lineno, False, by_name=True))
    return found


def _is_import_module(node: ast.Call) -> bool:
    func = node.func
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id == "import_module")


def _make(known, importer, target, line, local, by_name=False) -> Import:
    inside = _inside(known, target)
    return Import(importer, inside or target.split(".")[0], line, local, by_name)


def _walk(tree: ast.AST):
    """(node, inside a function) for every node, depth first."""
    stack = [(tree, False)]
    while stack:
        node, local = stack.pop()
        yield node, local
        inner = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack.extend((child, inner) for child in ast.iter_child_nodes(node))


def internal_edges(imports: list[Import], package: str) -> dict[str, set[str]]:
    """importer -> the package's modules it imports (a module's own package __init__ counts as one)."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.importer, set())
        if (imp.target == package or imp.target.startswith(package + ".")) and imp.target != imp.importer:
            graph[imp.importer].add(imp.target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted, largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found, key=lambda c: (-len(c), c))


def figures(root: Path) -> dict:
    """The tree's shape in numbers: modules per package, largest files, cycles, local imports."""
    known = package_modules(root)
    imports = read_imports(root)
    package = root.resolve().name
    per_package: dict[str, int] = {}
    for name, path in known.items():
        if path.name == "__init__.py":
            continue
        owner = name.rpartition(".")[0]
        per_package[owner] = per_package.get(owner, 0) + 1
    sizes = sorted(((len(p.read_text().splitlines()), n) for n, p in known.items()), reverse=True)
    statements = {(i.importer, i.line) for i in imports if not i.by_name}
    local = {(i.importer, i.line) for i in imports if i.local and not i.by_name}
    local_internal = {(i.importer, i.line) for i in imports if i.local and not i.by_name
                      and (i.target == package or i.target.startswith(package + "."))}
    return {
        "modules": len(known),
        "lines": sum(n for n, _ in sizes),
        "modules_per_package": dict(sorted(per_package.items())),
        "largest": sizes[:5],
        "cycles": cycles(internal_edges(imports, package)),
        "import_statements": len(statements),
        "function_local_imports": len(local),
        "function_local_internal_imports": len(local_internal),
    }


if __name__ == "__main__":
    result = figures(Path(sys.argv[1] if len(sys.argv) > 1 else "src/specdec"))
    print(f"modules: {result['modules']} ({result['lines']} lines)")
    for owner, count in result["modules_per_package"].items():
        print(f"  {owner}: {count}")
    print("largest:", ", ".join(f"{n.split('.', 1)[-1]} {size}" for size, n in result["largest"]))
    print(f"cycles: {len(result['cycles'])}")
    for component in result["cycles"]:
        print("  " + " <-> ".join(component))
    print(f"import statements: {result['import_statements']}, inside functions: "
          f"{result['function_local_imports']} (of the package's own modules: "
          f"{result['function_local_internal_imports']})")

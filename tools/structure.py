"""Structure check of the package: import circles, long functions, folders that are not their packages.

    python tools/structure.py [--root REPO]

1. The import graph of the package's modules: ``commfuse_dp/**`` as ``commfuse_dp.*``. Every ``import`` and
   ``from ... import`` counts, wherever it stands (inside functions, under ``if``, in ``try``), relative imports
   resolved against the importing module, and so does ``importlib.import_module("commfuse_dp....")`` (or
   ``import_module``) with a constant name. ``from package import name`` is an edge to ``package.name`` when that is a module, else to
   ``package``. An import of ``a.b.c`` is an edge to ``a.b.c`` alone (not to the packages above it). The strongly
   connected components of more than one module are the circles: modules that import each other, directly or
   through others, so none of them can be understood, tested or loaded without the rest.
2. Every function or method in ``commfuse_dp/`` longer than :data:`MAX_LINES` lines
   (``end_lineno - lineno + 1``: from the ``def`` line to its last line, docstring and nested functions included),
   except those in :data:`ALLOWED`, which hold data or help text rather than logic.

3. Every folder of the repository that holds importable code (``.py`` files; not ``tests/``, ``tools/`` or hidden
   and build folders) is a package at that path: it and every folder above it up to the root have an
   ``__init__.py``, and ``pyproject.toml`` maps no package to another folder (no ``package-dir``).

Prints all three; the exit status is 1 when there is a circle, a long function not allowed or a stray folder, else 0.
Uses only the standard library (``ast``): nothing of the package is imported.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from dataclasses import dataclass

MAX_LINES = 60

# package folder (relative to the repository root) -> the dotted name it is installed as
PACKAGE_DIRS = {"commfuse_dp": "commfuse_dp"}
NOT_CODE = ("tests", "tools", "build", "dist", "runs")  # top-level folders that are not importable code

# qualified name -> why it may be long. Only data tables and help text: splitting them would scatter one table or
# one text over functions that mean nothing on their own.
ALLOWED: dict[str, str] = {
    "commfuse_dp.launch.help.help_text": "the help text of `commfuse-dp launch`: one formatted string, no logic",
}


@dataclass(frozen=True)
class LongFunction:
    name: str      # qualified: module.Class.function
    path: str      # relative to the repository root
    line: int
    lines: int


def modules(root: str) -> dict[str, str]:
    """Dotted module name -> path of its file, for every ``.py`` file under :data:`PACKAGE_DIRS`."""
    found: dict[str, str] = {}
    for folder, dotted in PACKAGE_DIRS.items():
        base = os.path.join(root, folder)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            rel = os.path.relpath(dirpath, base)
            prefix = dotted if rel == os.curdir else dotted + "." + rel.replace(os.sep, ".")
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                stem = name[:-3]
                found[prefix if stem == "__init__" else f"{prefix}.{stem}"] = os.path.join(dirpath, name)
    return found


def _parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


def _known(name: str, known: dict[str, str]) -> str | None:
    """The longest prefix of ``name`` that is a module of the package, else None (a module from elsewhere)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in known:
            return candidate
    return None


def _base_of(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module named by ``from <base> import ...`` in ``module``."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    package = parts if is_package else parts[:-1]
    up = package[:len(package) - (node.level - 1)] if node.level > 1 else package
    return ".".join(up + ([node.module] if node.module else []))


def imports_of(module: str, tree: ast.Module, known: dict[str, str]) -> set[str]:
    """The package's modules that ``module`` imports anywhere in ``tree``."""
    is_package = known[module].endswith("__init__.py")
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                targets.add(_known(alias.name, known) or "")
        elif isinstance(node, ast.ImportFrom):
            base = _base_of(node, module, is_package)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in known else _known(base, known) or "")
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"):
            targets.add(_known(node.args[0].value, known) or "")
    targets.discard("")
    targets.discard(module)
    return targets


def import_graph(root: str) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports_of(name, _parse(path), known) for name, path in known.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def _functions(tree: ast.AST, prefix: str):
    """(qualified name, node) of every function in ``tree``, nested ones and methods included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}.{node.name}"
            yield name, node
            yield from _functions(node, name)
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}.{node.name}")
        else:
            yield from _functions(node, prefix)


def long_functions(root: str, max_lines: int = MAX_LINES) -> list[LongFunction]:
    """Every function of the package longer than ``max_lines`` lines (allowed or not), in file order."""
    found = []
    for module, path in modules(root).items():
        for name, node in _functions(_parse(path), module):
            lines = node.end_lineno - node.lineno + 1
            if lines > max_lines:
                found.append(LongFunction(name, os.path.relpath(path, root), node.lineno, lines))
    return found


def stray_folders(root: str) -> list[str]:
    """Folders holding ``.py`` files that are not packages at their path, and a ``package-dir`` mapping."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith(".")
                             and not d.endswith(".egg-info") and (rel != os.curdir or d not in NOT_CODE))
        if rel == os.curdir or not any(n.endswith(".py") for n in filenames):
            continue
        parts = rel.split(os.sep)
        for n in range(1, len(parts) + 1):
            if not os.path.isfile(os.path.join(root, *parts[:n], "__init__.py")):
                found.append(f"{'/'.join(parts[:n])}/ has no __init__.py, so {rel}/*.py is not importable at its path")
                break
    pyproject = os.path.join(root, "pyproject.toml")
    if os.path.isfile(pyproject) and "package-dir" in open(pyproject, encoding="utf-8").read():
        found.append("pyproject.toml maps packages to other folders (package-dir)")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        help="the repository root (default: this file's repository)")
    args = parser.parse_args(argv)

    graph = import_graph(args.root)
    found = circles(graph)
    edges = sum(len(t) for t in graph.values())
    print(f"import graph: {len(graph)} modules, {edges} imports between them")
    print(f"circles: {len(found)}")
    for i, component in enumerate(found, 1):
        print(f"  {i}. {len(component)} modules:")
        members = set(component)
        for name in component:
            print(f"     {name} -> {', '.join(sorted(graph[name] & members))}")

    long = long_functions(args.root)
    refused = [f for f in long if f.name not in ALLOWED]
    print(f"functions over {MAX_LINES} lines: {len(refused)} (allowed: {len(long) - len(refused)})")
    for f in long:
        why = ALLOWED.get(f.name)
        note = f"  allowed: {why}" if why else ""
        print(f"  {f.lines:4d}  {f.name}  ({f.path}:{f.line}){note}")
    stray = stray_folders(args.root)
    print(f"folders that are not the package at their path: {len(stray)}")
    for line in stray:
        print(f"  {line}")
    return 1 if found or refused or stray else 0


if __name__ == "__main__":
    raise SystemExit(main())

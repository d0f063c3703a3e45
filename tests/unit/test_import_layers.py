"""Import layering of ``shardspeed/``: no cycles between its parts, no library use of testing.

Nodes: each sub-folder of ``shardspeed/`` (``zero/``, ``runtime/``, ...), each top-level
module (``topology.py``, ``accelerator.py``, ...) and ``shardspeed/__init__.py``. An edge
``a -> b`` is any ``import`` of ``b`` in a file of ``a``: at module level, inside functions
and under ``TYPE_CHECKING`` alike. ``importlib.import_module("shardspeed...")`` with a
literal name counts too, except in the public-API facades that load submodules lazily
(:data:`LAZY_FACADES`). An import of one of DeepSpeed's moved paths
(:data:`shardspeed._submodules.MOVED_MODULES`, e.g. ``shardspeed.utils.groups``) counts as an
import of the module that defines it (``shardspeed.runtime.groups``): the edge follows the
code, not the name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from shardspeed._submodules import MOVED_MODULES

PACKAGE = Path(__file__).resolve().parents[2] / "shardspeed"

# Files whose string-based importlib.import_module(...) is a public-API lazy facade.
LAZY_FACADES = frozenset({"__init__.py", "utils/__init__.py", "ops/__init__.py"})


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    if name in MOVED_MODULES:
        return True
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file()


def _node(module: str) -> str:
    """``shardspeed.zero.partition`` -> ``zero/``; ``shardspeed.topology`` -> ``topology.py``."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__.py"
    return f"{parts[1]}/" if (PACKAGE / parts[1]).is_dir() else f"{parts[1]}.py"


def _package_of(path: Path) -> str:
    """The package that relative imports in ``path`` start from."""
    name = _module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _imported_modules(path: Path) -> Iterator[str]:
    """Every ``shardspeed`` module ``path`` imports (``from a import b`` -> ``a.b`` if a module)."""
    for imported in _imported_names(path, _package_of(path)):
        yield MOVED_MODULES.get(imported, imported)


def _imported_names(path: Path, package: str) -> Iterator[str]:
    """The module names as written in ``path`` (moved DeepSpeed paths not yet resolved)."""
    count_strings = str(path.relative_to(PACKAGE)) not in LAZY_FACADES
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                yield submodule if _is_module(submodule) else base
        elif (
            count_strings
            and isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.args[0].value


def _edges() -> dict[tuple[str, str], list[str]]:
    """``(from_node, to_node)`` -> the ``module -> imported`` lines behind that edge."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = _module_name(path)
        for target in _imported_modules(path):
            if target != "shardspeed" and not target.startswith("shardspeed."):
                continue
            pair = (_node(source), _node(target))
            line = f"{source} -> {target}"
            if pair[0] != pair[1] and line not in edges.get(pair, []):
                edges.setdefault(pair, []).append(line)
    return edges


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_no_import_cycles_between_folders() -> None:
    edges = _edges()
    graph: dict[str, set[str]] = {}
    for source, target in edges:
        graph.setdefault(source, set()).add(target)
    cycles = _cycles(graph)
    report = []
    for component in cycles:
        report.append(" <-> ".join(component))
        for (source, target), lines in sorted(edges.items()):
            if source in component and target in component:
                report.extend(f"    {line}" for line in lines[:4])
    assert not cycles, (
        "import cycles between parts of shardspeed/ (move the shared code to the lower "
        "layer or invert the dependency):\n" + "\n".join(report)
    )


def test_library_never_imports_testing() -> None:
    offenders = [
        line
        for (source, target), lines in sorted(_edges().items())
        if target == "testing/" and source != "testing/"
        for line in lines
    ]
    assert not offenders, (
        "library modules import shardspeed.testing (module-state resets belong in "
        "shardspeed.utils.reset_hooks):\n" + "\n".join(offenders)
    )


def test_cycle_finder() -> None:
    # The cycle finder itself: a -> b -> c -> a is one component, d -> a is not in it.
    graph = {"a/": {"b/"}, "b/": {"c/"}, "c/": {"a/"}, "d/": {"a/"}}
    assert _cycles(graph) == [["a/", "b/", "c/"]]


def test_moved_deepspeed_paths_are_served_not_imported() -> None:
    # A moved path is no file (the finder in shardspeed._submodules serves it as the module
    # that defines it), and library code imports that module by its own name.
    for moved, defining in sorted(MOVED_MODULES.items()):
        assert not _is_file_module(moved), f"{moved} is both a file and a moved path"
        assert _is_file_module(defining), f"MOVED_MODULES[{moved!r}]: {defining} does not exist"
    importers = [
        f"{_module_name(path)} -> {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name in _imported_names(path, _package_of(path))
        if name in MOVED_MODULES
    ]
    assert not importers, (
        "library code imports a moved DeepSpeed path; import the defining module instead "
        f"({MOVED_MODULES}):\n" + "\n".join(importers)
    )


def _is_file_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return (path / "__init__.py").is_file() or path.with_suffix(".py").is_file()

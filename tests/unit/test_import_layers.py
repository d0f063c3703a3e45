"""Import layering of ``shardspeed/``: no cycles between its parts, no library use of testing.

Nodes: each sub-folder of ``shardspeed/`` (``zero/``, ``runtime/``, ...), each top-level
module (``topology.py``, ``accelerator.py``, ...) and ``shardspeed/__init__.py``. An edge
``a -> b`` is any ``import`` of ``b`` in a file of ``a``: at module level, inside functions
and under ``TYPE_CHECKING`` alike. ``importlib.import_module("shardspeed...")`` with a
literal name counts too, except in the public-API facades that load submodules lazily
(:data:`LAZY_FACADES`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "shardspeed"

# Files whose string-based importlib.import_module(...) is a public-API lazy facade.
LAZY_FACADES = frozenset({"__init__.py", "utils/__init__.py", "ops/__init__.py"})

# Thin modules at DeepSpeed's import paths that re-export code from a higher layer
# (``deepspeed.utils.groups`` needs the topology). Their imports are not edges: nothing in
# shardspeed imports them and they define nothing (checked below), so they cannot close a
# cycle; the code they re-export is layered like any other.
DEEPSPEED_PATH_SHIMS = frozenset({"utils/groups.py", "utils/zero_to_fp32.py"})


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file()


def _node(module: str) -> str:
    """``shardspeed.zero.partition`` -> ``zero/``; ``shardspeed.topology`` -> ``topology.py``."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__.py"
    return f"{parts[1]}/" if (PACKAGE / parts[1]).is_dir() else f"{parts[1]}.py"


def _imported_modules(path: Path) -> Iterator[str]:
    """Every ``shardspeed`` module ``path`` imports (``from a import b`` -> ``a.b`` if a module)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
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
        if str(path.relative_to(PACKAGE)) in DEEPSPEED_PATH_SHIMS:
            continue
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


def test_deepspeed_path_shims_are_thin_leaves() -> None:
    shim_modules = {_module_name(PACKAGE / shim) for shim in DEEPSPEED_PATH_SHIMS}
    importers = [
        f"{_module_name(path)} -> {target}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for target in _imported_modules(path)
        if target in shim_modules
    ]
    assert not importers, (
        f"DeepSpeed path shims must not be imported inside shardspeed: {importers}"
    )
    for shim in sorted(DEEPSPEED_PATH_SHIMS):
        tree = ast.parse((PACKAGE / shim).read_text())
        for node in tree.body:
            is_docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            is_all = isinstance(node, ast.Assign) and [
                getattr(t, "id", None) for t in node.targets
            ] == ["__all__"]
            is_main = isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
            assert isinstance(node, ast.ImportFrom) or is_docstring or is_all or is_main, (
                f"{shim} line {node.lineno}: a DeepSpeed path shim only re-exports; move the "
                "code to the module it re-exports from"
            )

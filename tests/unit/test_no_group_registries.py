"""No module-level registries of process groups or topologies in ``shardspeed/``.

Process groups belong to the one :class:`~shardspeed.topology.Topology` of a layout, and
the Topologies that code finds without being handed one live in one cache,
:data:`shardspeed.parallel.topology_cache.TOPOLOGIES`, whose lifetime is the world group's.
A module-level ``dict``/``list`` of groups or topologies beside it (DeepSpeed's
``_EXPERT_PARALLEL_GROUP = {}`` style) outlives ``destroy_process_group``: it hands out dead
groups after a re-init and keeps their gloo threads alive in long-lived processes (the warm
test workers once reached ~1000 threads that way).

The scan (AST, module level and class bodies) flags a binding when

* its annotation names ``Topology``, ``TopologyCache``, ``ProcessGroup*`` or ``DeviceMesh``;
* its value builds one (a call of such a name, ``new_group``, ``init_device_mesh``, ...) or
  is a container holding such expressions;
* it is a module-level mutable container (``{}``, ``[]``, ``dict()``, ``defaultdict(...)``,
  ...) named for topologies, groups or meshes, unless its contents are all constants (an
  axis-name table); in class bodies only the type rules apply;
* a function rebinds such a name with ``global``.

``weakref.WeakKeyDictionary`` side tables keyed by a group (its timeout, its ranks) are not
registries: they die with the group. A determined rename can hide a registry from any scan;
this one catches the usual shapes, and :data:`ALLOWED` names the one owner.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "shardspeed"

# (file under shardspeed/, name): the one place topologies are kept.
ALLOWED = frozenset({("parallel/topology_cache.py", "TOPOLOGIES")})

_TYPES = re.compile(r"^(Topology|TopologyCache|ProcessGroup\w*|DeviceMesh)$")
_BUILDERS = re.compile(r"^(new_group|new_subgroups\w*|split_group|init_device_mesh)$")
_NAMES = re.compile(r"topolog|group|mesh", re.IGNORECASE)
_CONTAINER_CALLS = frozenset(
    {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "WeakValueDictionary"}
)
_DISPLAYS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)


def _identifiers(node: ast.AST, *, annotation: bool = False) -> Iterator[str]:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            yield sub.id
        elif isinstance(sub, ast.Attribute):
            yield sub.attr
        elif annotation and isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            yield from re.findall(r"\w+", sub.value)  # a string annotation: "dict[int, Topology]"


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


def _builds_group_or_topology(node: ast.AST) -> bool:
    """``node`` contains a call that makes a Topology / group / mesh."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            callee = _callee(sub)
            owner = sub.func.value if isinstance(sub.func, ast.Attribute) else None
            owner_name = owner.id if isinstance(owner, ast.Name) else ""
            if _TYPES.match(callee) or _BUILDERS.match(callee) or _TYPES.match(owner_name):
                return True
    return False


def _is_container(value: ast.AST) -> bool:
    if isinstance(value, _DISPLAYS):
        return True
    return isinstance(value, ast.Call) and _callee(value) in _CONTAINER_CALLS


def _only_constants(value: ast.AST) -> bool:
    """A non-empty display of literals and ALL_CAPS constants (``{"pipe": ("pipe",)}``)."""
    if not isinstance(value, (ast.Dict, ast.List, ast.Set)):
        return False
    if not (value.keys if isinstance(value, ast.Dict) else value.elts):
        return False
    literal = (ast.Dict, ast.List, ast.Set, ast.Tuple, ast.Constant, ast.Load)
    return all(
        isinstance(n, literal) or (isinstance(n, ast.Name) and n.id.isupper())
        for n in ast.walk(value)
    )


def _binding_problems(
    target: str, annotation: ast.AST | None, value: ast.AST | None, *, by_name: bool = True
) -> list[str]:
    problems = []
    if annotation is not None and any(
        _TYPES.match(i) for i in _identifiers(annotation, annotation=True)
    ):
        problems.append("annotated as holding topologies/groups")
    if value is not None:
        if _builds_group_or_topology(value):
            problems.append("builds a topology/group at import")
        elif _is_container(value) and any(_TYPES.match(i) for i in _identifiers(value)):
            problems.append("a container of topologies/groups")
        if (
            by_name
            and _is_container(value)
            and _NAMES.search(target)
            and not _only_constants(value)
        ):
            problems.append("a mutable container named for topologies/groups/meshes")
    return problems


def _bindings(body: list[ast.stmt]) -> Iterator[tuple[int, str, ast.AST | None, ast.AST | None]]:
    for node in body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        yield node.lineno, name.id, None, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            yield node.lineno, node.target.id, node.annotation, node.value


def find_registries(source: str, filename: str = "<source>") -> list[str]:
    """Every module-level (or class-level) registry of topologies/groups in ``source``."""
    tree = ast.parse(source, filename=filename)
    found = []
    for lineno, name, annotation, value in _bindings(tree.body):
        for problem in _binding_problems(name, annotation, value):
            found.append(f"{filename}:{lineno} {name}: {problem}")
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        # Class-level containers of topologies (by type only: "groups" in a config model's
        # field name means something else, and pydantic copies field defaults).
        for lineno, name, annotation, value in _bindings(cls.body):
            if value is not None and _is_container(value):
                for problem in _binding_problems(name, annotation, value, by_name=False):
                    found.append(f"{filename}:{lineno} {cls.name}.{name}: {problem}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            for name in node.names:
                if _NAMES.search(name):
                    found.append(f"{filename}:{node.lineno} global {name}: rebinds a group global")
    return found


def test_no_module_level_group_or_topology_registries() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        for line in find_registries(path.read_text(), rel):
            name = line.split(" ", 1)[1].split(":", 1)[0]
            if (rel, name) not in ALLOWED:
                found.append(line)
    assert not found, (
        "module-level process-group/topology state outside the one cache "
        "(shardspeed.parallel.topology_cache.TOPOLOGIES); keep groups on a Topology and "
        "cached Topologies in TOPOLOGIES:\n" + "\n".join(found)
    )


def test_the_allowed_owner_exists() -> None:
    for rel, name in ALLOWED:
        lines = find_registries((PACKAGE / rel).read_text(), rel)
        assert any(line.split(" ", 1)[1].startswith(f"{name}:") for line in lines), (
            f"ALLOWED lists {rel}:{name}, which no longer exists; remove it from ALLOWED"
        )


def test_the_scan_catches_the_usual_shapes() -> None:
    shapes = {
        "_TOPOLOGIES: dict[int, tuple[Any, Topology]] = {}": "annotated",
        "_TOPOLOGIES = {}": "named for",
        "_EXPERT_PARALLEL_GROUP = dict()": "named for",
        "_MESHES = defaultdict(list)": "named for",
        "_CACHE = TopologyCache()": "builds",
        "_DEFAULT = Topology.build(tp=2)": "builds",
        "_PG = dist.new_group([0, 1])": "builds",
        "_BY_SIZE = {2: Topology(4, tp=2)}": "builds",
        "_GROUPS: list[ProcessGroup] = []": "annotated",
        '_X: "dict[int, DeviceMesh]" = {}': "annotated",
        "class Holder:\n    by_size: dict[int, Topology] = {}": "annotated",
        "def set_group(g):\n    global _DATA_PARALLEL_GROUP\n    _DATA_PARALLEL_GROUP = g": "global",
    }
    for source, expected in shapes.items():
        found = find_registries(source)
        assert any(expected in line for line in found), (source, found)
    fine = [
        'GROUP_AXES: dict[str, tuple[str, ...]] = {"pipe": ("pipe",), "data": ("a", "b")}',
        '_AXIS_TO_TOPOLOGY = {"pipe": "pp", "tensor": "tp"}',
        "_GROUP_TIMEOUTS: weakref.WeakKeyDictionary[Any, timedelta] = weakref.WeakKeyDictionary()",
        "Grid = Topology",
        "def f(topology: Topology) -> None:\n    groups = {}",
        "@dataclass\nclass Plan:\n    topology: Topology\n    group: Any = None",
        "class Quant(BaseModel):\n    different_groups: dict[str, Any] = {}",
        '_LAZY = {"Topology": ("shardspeed.topology", "Topology")}',
    ]
    for source in fine:
        assert find_registries(source) == [], source

"""DeepSpeed's ZeRO-3 leaf modules (``deepspeed.utils.set_z3_leaf_modules``).

In DeepSpeed a leaf module's parameters are gathered all at once when it runs, instead of
submodule by submodule (a mixture-of-experts block, where only some experts run). In
ShardSpeed stage 3 gathers whole *units* (each element of a ``ModuleList``/``Sequential``,
see :func:`shardspeed.zero.unit_sharding.split_units`), so a leaf module inside a unit is
already fetched as a whole. :func:`set_z3_leaf_modules` flags the modules as DeepSpeed does
(``module._z3_leaf``; by class, or by name / name suffix in ``model.named_modules()``)
and refuses the one layout where the flag would not hold: a leaf
module that contains units of its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

from shardspeed.zero.unit_sharding import split_units

LeafClasses = list[type] | list[str]


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether ``model`` is flagged as a leaf module."""
    return bool(getattr(model, "_z3_leaf", False))


def z3_leaf_parameter(param: nn.Parameter) -> bool:
    """Whether ``param`` belongs to a leaf module."""
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` flagged as leaf modules."""
    return [module for module in model.modules() if z3_leaf_module(module)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    model._z3_leaf = flag


def _matches(module: nn.Module, classes: LeafClasses) -> bool:
    cls = type(module)
    qualified = f"{cls.__module__}.{cls.__qualname__}"
    return any(
        isinstance(module, c) if isinstance(c, type) else c in (cls.__name__, qualified)
        for c in classes
    )


def _set(
    model: nn.Module, leaf_module_classes: LeafClasses, flag: bool, raise_if_not_found: bool
) -> list[nn.Module]:
    if not all(isinstance(c, type | str) for c in leaf_module_classes):
        raise ValueError(
            f"leaf_module_classes must be a list of module classes or class names, got "
            f"{leaf_module_classes!r}."
        )
    found = [module for module in model.modules() if _matches(module, leaf_module_classes)]
    if not found and raise_if_not_found:
        raise ValueError(
            f"No modules of type {leaf_module_classes} found in model {type(model).__name__}; "
            "pass a class (or class name) the model contains, or raise_if_not_found=False."
        )
    _flag(found, model, flag)
    return found


def _flag(leaves: list[nn.Module], model: nn.Module, flag: bool) -> None:
    """Set ``_z3_leaf`` on ``leaves``, refusing leaves that hold stage-3 units of their own."""
    if flag:
        unit_modules = {id(unit.module) for unit in split_units(model) if not unit.is_root}
        for leaf in leaves:
            inner = [m for m in leaf.modules() if m is not leaf and id(m) in unit_modules]
            if inner:
                raise ValueError(
                    f"set_z3_leaf_modules: {type(leaf).__name__} holds {len(inner)} stage-3 "
                    "units of its own (elements of a ModuleList/Sequential not inside an "
                    "outer ModuleList), so ShardSpeed would gather them one by one. Fix: put "
                    "the leaf module inside the model's layer list, or leave it unflagged."
                )
    for leaf in leaves:
        leaf._z3_leaf = flag


def _named(
    model: nn.Module,
    patterns: list[str],
    matches: Callable[[str, str], bool],
    what: str,
    flag: bool,
    raise_if_not_found: bool,
) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules whose ``named_modules()`` name matches a pattern; returns the
    modules (each once, in pattern order) and the patterns that matched nothing."""
    named = list(model.named_modules())
    found: dict[int, nn.Module] = {}
    missing: list[str] = []
    for pattern in patterns:
        hits = [module for name, module in named if matches(name, pattern)]
        if not hits:
            missing.append(pattern)
        for module in hits:
            found.setdefault(id(module), module)
    if missing and raise_if_not_found:
        examples = [name for name, _ in named if name][:5]
        raise ValueError(
            f"No modules {what} {missing} found in model {type(model).__name__} (module names "
            f"look like {examples}); pass names from model.named_modules(), or "
            "raise_if_not_found=False."
        )
    leaves = list(found.values())
    _flag(leaves, model, flag)
    return leaves, missing


def set_z3_leaf_modules_by_name(
    model: nn.Module, module_names: list[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Set the leaf flag of the modules called ``module_names`` in ``model.named_modules()``;
    returns the modules and the names that matched none."""
    return _named(
        model, module_names, lambda name, want: name == want, "named", flag, raise_if_not_found
    )


def set_z3_leaf_modules_by_suffix(
    model: nn.Module,
    module_name_suffixes: list[str],
    flag: bool = True,
    raise_if_not_found: bool = True,
) -> tuple[list[nn.Module], list[str]]:
    """Set the leaf flag of every module whose ``named_modules()`` name ends with one of
    ``module_name_suffixes`` (e.g. ``"mlp.experts"``); returns the modules (each once) and
    the suffixes that matched none."""
    return _named(
        model,
        module_name_suffixes,
        lambda name, suffix: name.endswith(suffix),
        "matching suffixes",
        flag,
        raise_if_not_found,
    )


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: LeafClasses, raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Flag the modules of these classes (or class names) as ZeRO-3 leaf modules; returns
    them."""
    return _set(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: LeafClasses, raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Clear the leaf flag of the modules of these classes; returns them."""
    return _set(model, leaf_module_classes, False, raise_if_not_found)


__all__ = [
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]

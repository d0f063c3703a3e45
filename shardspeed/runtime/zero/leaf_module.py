"""DeepSpeed's ZeRO-3 leaf modules (``deepspeed.utils.set_z3_leaf_modules``).

In DeepSpeed a leaf module's parameters are gathered all at once when it runs, instead of
submodule by submodule (a mixture-of-experts block, where only some experts run). In
ShardSpeed stage 3 gathers whole *units* (each element of a ``ModuleList``/``Sequential``,
see :func:`shardspeed.zero.unit_sharding.split_units`), so a leaf module inside a unit is
already fetched as a whole. :func:`set_z3_leaf_modules` flags the modules as DeepSpeed does
(``module._z3_leaf``) and refuses the one layout where the flag would not hold: a leaf
module that contains units of its own.
"""

from __future__ import annotations

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
    if flag:
        unit_modules = {id(unit.module) for unit in split_units(model) if not unit.is_root}
        for leaf in found:
            inner = [m for m in leaf.modules() if m is not leaf and id(m) in unit_modules]
            if inner:
                raise ValueError(
                    f"set_z3_leaf_modules: {type(leaf).__name__} holds {len(inner)} stage-3 "
                    "units of its own (elements of a ModuleList/Sequential not inside an "
                    "outer ModuleList), so ShardSpeed would gather them one by one. Fix: put "
                    "the leaf module inside the model's layer list, or leave it unflagged."
                )
    for leaf in found:
        leaf._z3_leaf = flag
    return found


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
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]

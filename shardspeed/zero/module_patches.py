"""The process-wide patches behind ``zero.Init``: wrapped module constructors and init functions.

While at least one ``zero.Init`` context is active, the ``__init__`` of every ``nn.Module``
subclass (those already imported, and those defined later, through
``nn.Module.__init_subclass__``) is wrapped: when the *outermost* ``__init__`` of an
object returns (the most derived class's, so a subclass can still edit what its parents
created), the innermost active context partitions the module's own parameters. The
``torch.nn.init`` functions are wrapped too: on a partitioned parameter they run on a
temporary full tensor (:func:`shardspeed.zero.init_partition.reinitialize`). Everything
is restored when the last context exits (:meth:`_Patches.uninstall`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.nn as nn

from shardspeed.utils.reset_hooks import register_reset_hook
from shardspeed.zero.init_partition import is_init_partitioned, reinitialize


class _Context(Protocol):
    def partition_module(self, module: nn.Module) -> None: ...


_INIT_FUNCTIONS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
    "sparse_",
)  # fmt: skip


class _Patches:
    """The process-wide wrapping of ``nn.Module`` constructors and ``torch.nn.init``."""

    def __init__(self) -> None:
        self.active: list[_Context] = []  # entered contexts, innermost last
        self.originals: dict[type, Callable[..., None]] = {}  # class -> its own __init__
        self.init_fns: dict[str, Callable[..., Any]] = {}
        self.init_subclass: Any = None  # nn.Module.__dict__'s __init_subclass__, if any
        self.installed = False
        self.building: set[int] = set()  # id() of modules inside their outermost __init__
        self.ids = itertools.count()

    # -- contexts ---------------------------------------------------------------------
    def push(self, context: _Context) -> None:
        """A context was entered: it partitions what is built from now on."""
        self.active.append(context)
        self.install()

    def pop(self, context: _Context) -> None:
        """A context exited: drop it (its last entry); restore everything after the last."""
        for i in range(len(self.active) - 1, -1, -1):
            if self.active[i] is context:
                del self.active[i]
                break
        if not self.active:
            self.uninstall()

    # -- install / uninstall ------------------------------------------------------------
    def install(self) -> None:
        if self.installed:
            return
        self.installed = True
        for cls in _all_module_classes():
            self.wrap_class(cls)
        self.init_subclass = nn.Module.__dict__.get("__init_subclass__")
        nn.Module.__init_subclass__ = classmethod(_on_subclass)  # type: ignore[assignment]
        for name in _INIT_FUNCTIONS:
            fn = getattr(torch.nn.init, name)
            self.init_fns[name] = fn
            setattr(torch.nn.init, name, _wrap_init_fn(fn))

    def uninstall(self) -> None:
        if not self.installed:
            return
        for cls, original in self.originals.items():
            cls.__init__ = original  # type: ignore[misc]
        self.originals.clear()
        if self.init_subclass is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = self.init_subclass  # type: ignore[assignment]
        for name, fn in self.init_fns.items():
            setattr(torch.nn.init, name, fn)
        self.init_fns.clear()
        self.building.clear()
        self.installed = False

    def wrap_class(self, cls: type) -> None:
        original = cls.__dict__.get("__init__")
        if cls in self.originals or not inspect.isfunction(original):
            return  # inherits a (wrapped) __init__, or is already wrapped
        self.originals[cls] = original
        cls.__init__ = _wrap_constructor(original)  # type: ignore[misc]

    def reset(self) -> None:
        """Undo everything (test-harness reset between calls)."""
        self.active.clear()
        self.uninstall()


PATCHES = _Patches()


def _all_module_classes() -> list[type]:
    seen: dict[type, None] = {nn.Module: None}
    stack = [nn.Module]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in seen:
                seen[sub] = None
                stack.append(sub)
    return list(seen)


def _on_subclass(cls: type, **kwargs: Any) -> None:
    """``nn.Module.__init_subclass__`` while a context is active: wrap the new class too."""
    PATCHES.wrap_class(cls)
    super(nn.Module, cls).__init_subclass__(**kwargs)  # type: ignore[misc]


def _wrap_constructor(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        if id(self) in PATCHES.building:  # a parent's __init__ called through super()
            original(self, *args, **kwargs)
            return
        PATCHES.building.add(id(self))
        try:
            original(self, *args, **kwargs)
        finally:
            PATCHES.building.discard(id(self))
        if PATCHES.active:
            PATCHES.active[-1].partition_module(self)

    return __init__


def _wrap_init_fn(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if isinstance(tensor, nn.Parameter) and is_init_partitioned(tensor):
            from shardspeed.zero.params import ZeroParamStatus

            if tensor.ds_status is not ZeroParamStatus.AVAILABLE:  # type: ignore[attr-defined]
                reinitialize(tensor, fn, args, kwargs)
                return tensor
        return fn(tensor, *args, **kwargs)

    return wrapped


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Suspend every active ``zero.Init`` for the block (``initialize()`` builds its engine here)."""
    if not PATCHES.installed:
        yield
        return
    PATCHES.uninstall()
    try:
        yield
    finally:
        if PATCHES.active:
            PATCHES.install()


register_reset_hook(PATCHES.reset)

"""``LayerSpec`` / ``TiedLayerSpec``: layers described now, built only on the stage that owns them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn


class LayerSpec:
    """A layer's class and constructor arguments; ``build()`` makes the module.

    ``PipelineModule`` builds a spec only on the stage that owns the layer, so a model
    too large for one process can still be described in full on every rank::

        LayerSpec(torch.nn.Linear, 1024, 1024, bias=False)
    """

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise ValueError(
                f"LayerSpec(typename={typename!r}): typename must be a torch.nn.Module subclass "
                "(the class itself, not an instance); wrap plain functions in the layers list "
                "directly instead."
            )
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        """Construct the module (on the current default device)."""
        return self.typename(*self.module_args, **self.module_kwargs)

    def num_trainable_parameters(self) -> int:
        """Trainable parameter count, computed on the meta device (no memory, no RNG use)."""
        try:
            with torch.device("meta"):
                module = self.build()
        except Exception:  # constructors that need real data: build on CPU once
            module = self.build()
        return sum(p.numel() for p in module.parameters() if p.requires_grad)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args]
        args += [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{type(self).__name__}({self.typename.__name__}, {', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose weights are shared by every layer with the same ``key``.

    Each stage holding a ``key`` builds the module once; the engine starts every copy
    from the lowest stage's values and sums the gradients of ``tied_weight_attr`` over
    the stages holding the key, so the copies take identical steps. ``forward_fn(module,
    inputs)`` replaces ``module(inputs)`` where the layer appears (e.g. an embedding
    reused as the LM head: ``forward_fn=lambda emb, x: x @ emb.weight.t()``).

    ``tied_weight_attr`` names the tied parameter(s): an attribute path (``"weight"``,
    ``"wte.weight"``) or a list of them.
    """

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        tied_weight_attr: str | list[str] = "weight",
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key:
            raise ValueError(f"TiedLayerSpec(key={key!r}): key must be a non-empty string.")
        self.key = key
        self.forward_fn = forward_fn
        attrs = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        if not attrs or not all(isinstance(a, str) and a for a in attrs):
            raise ValueError(
                f"TiedLayerSpec(tied_weight_attr={tied_weight_attr!r}): expected an attribute "
                "name such as 'weight' or a list of them."
            )
        self.tied_weight_attr = attrs


def resolve_attr(module: nn.Module, path: str) -> nn.Parameter:
    """``module.<path>`` for a dotted ``path``; must be a parameter."""
    obj: Any = module
    for part in path.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"tied_weight_attr={path!r}: {type(module).__name__} has no attribute "
                f"{part!r}; name a parameter of the tied module (e.g. 'weight')."
            )
        obj = getattr(obj, part)
    if not isinstance(obj, nn.Parameter):
        raise ValueError(
            f"tied_weight_attr={path!r} on {type(module).__name__} is a "
            f"{type(obj).__name__}, not an nn.Parameter."
        )
    return obj


def layer_class_name(layer: Any) -> str:
    """The class name used by ``partition_method='type:<regex>'``."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def layer_num_parameters(layer: Any) -> int:
    """Trainable parameters of a spec, module or callable (0 for plain functions)."""
    if isinstance(layer, LayerSpec):
        return layer.num_trainable_parameters()
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0

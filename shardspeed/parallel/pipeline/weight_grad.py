"""The B/W split: deferred weight gradients of ``nn.Linear`` layers (zero-bubble pipelines).

Zero-bubble schedules cut the backward pass of a micro-batch in two:

* **B** (input gradients): the gradient of the stage's input, which the previous stage
  waits for, and the gradients of every parameter that is not a Linear weight or bias
  (LayerNorm, Embedding, ...);
* **W** (weight gradients): ``grad_W = grad_out^T @ input`` and ``grad_b = sum(grad_out)``
  of every Linear layer. Nobody waits for them, so the schedule runs W in what would
  otherwise be pipeline bubbles.

How it works. While a :class:`WeightGradSplit` is :meth:`~WeightGradSplit.active`, every
``nn.Linear`` inside its module (subclasses included) routes ``F.linear(x, self.weight,
self.bias)`` through :class:`_DeferrableLinear` whenever autograd records. The weight and
bias enter that function *detached*, so autograd never accumulates them itself (and no
grad-ready hook fires for them during B); the function's backward returns the input
gradient and, inside :meth:`~WeightGradSplit.deferring` (the executor's B for
micro-batch ``key``), keeps ``(input, grad_output)`` under ``key``.
:meth:`~WeightGradSplit.apply` (the W of ``key``) computes the weight gradients and
hands them to autograd's own ``AccumulateGrad`` with one ``torch.autograd.backward(params,
grads)`` call, so ``param.grad`` is created or added to (in place, e.g. into a flat
buffer's view) exactly as in a plain backward, and ``register_post_accumulate_grad_hook``
hooks (the gradient reducer's) fire once per parameter per W. W drops the stash. A
backward outside :meth:`deferring` (a fused ``BackwardPass``) accumulates at once, the
same way.

* Plain ``nn.Linear`` (``forward`` not overridden): its ``forward`` is replaced for the
  duration of :meth:`active`. A subclass with its own ``forward`` keeps it; a torch
  function mode active inside that call reroutes the ``F.linear`` calls that use the
  layer's own weight (``super().forward(x)`` included). Other code paths (a forward that
  uses ``x @ self.weight.t()``) are left alone: those weights get their gradient in B.
* Outside :meth:`active`, or under ``torch.no_grad()``, a layer runs its original
  ``forward``: results are bitwise those of plain autograd. Inside, the weight gradient
  is ``grad_out^T @ input`` in one matmul, which may differ from autograd's kernel in
  the last bits (1e-7 relative in fp32).
* Not supported while active: double backward (``create_graph=True``) through a Linear,
  and ``torch.autograd.grad`` with respect to a Linear weight (it has no graph edge).
* Activation checkpointing works: a checkpointed group recomputes its forward inside B
  (reentrant: ``CheckpointFunction.backward``; non-reentrant: on unpacking saved tensors),
  the recomputed Linear calls run through :class:`_DeferrableLinear` and defer to the
  same key. The stash then holds the recomputed inputs until W.
* Memory: per deferred Linear call the stash holds its input and its output gradient
  from B until W (the paper's ``M_W``); :meth:`apply` releases them.
* ZeRO-3 parameters (partitioned, gathered only around their module's forward/backward)
  are refused unless the caller keeps them gathered until the last W
  (``partitioned_ok``: a pipeline stage gathered once per batch); otherwise W would run
  after they were released.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


@dataclass
class _Deferred:
    """One Linear call's weight-gradient work, kept from B until W."""

    weight: nn.Parameter | None  # None when the weight needs no gradient
    bias: nn.Parameter | None
    inputs: torch.Tensor  # (..., in_features)
    grad_output: torch.Tensor  # (..., out_features)


def linear_weight_grads(
    inputs: torch.Tensor, grad_output: torch.Tensor, need_weight: bool, need_bias: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(grad_W, grad_b)`` of ``y = x W^T + b`` from the input and the output gradient."""
    g2d = grad_output.reshape(-1, grad_output.shape[-1])  # (N, out)
    x2d = inputs.to(grad_output.dtype).reshape(-1, inputs.shape[-1])  # (N, in)
    grad_weight = g2d.t().mm(x2d) if need_weight else None  # (out, in)
    grad_bias = g2d.sum(0) if need_bias else None  # (out,)
    return grad_weight, grad_bias


class _DeferrableLinear(torch.autograd.Function):
    """``F.linear`` whose weight gradients go through the split, not through the graph.

    The parameters enter the graph detached (so no ``AccumulateGrad`` of theirs runs, and
    no grad-ready hook fires, during B); ``params`` holds the parameters themselves.
    ``anchor`` (an empty leaf that requires grad) keeps the output in the graph when the
    input does not require grad (the first stage), as the weight would have.
    Backward returns the input gradient and either stashes the weight-gradient work (B)
    or accumulates it at once (a fused backward).
    """

    @staticmethod
    def forward(
        ctx: Any,
        inputs: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        anchor: torch.Tensor,
        params: tuple[nn.Parameter | None, nn.Parameter | None],
        split: WeightGradSplit,
    ) -> torch.Tensor:
        ctx.save_for_backward(inputs, weight)
        ctx.params, ctx.split = params, split
        return F.linear(inputs, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        inputs, weight = ctx.saved_tensors
        need_input = ctx.needs_input_grad[0]
        grad_input = grad_output @ weight.to(grad_output.dtype) if need_input else None
        weight_param, bias_param = ctx.params
        if weight_param is not None or bias_param is not None:
            item = _Deferred(weight_param, bias_param, inputs, grad_output)
            if ctx.split.defer_key is not None:  # B: keep what W needs
                ctx.split.stash(ctx.split.defer_key, item)
            else:  # a fused backward: accumulate now
                ctx.split.accumulate([item])
        return grad_input, None, None, None, None, None


def _deferrable_linear(
    inputs: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    split: WeightGradSplit,
) -> torch.Tensor:
    trainable = (
        weight if weight.requires_grad else None,
        bias if bias is not None and bias.requires_grad else None,
    )
    if trainable == (None, None):  # frozen layer: nothing to defer
        return F.linear(inputs, weight, bias)
    detached_bias = None if bias is None else bias.detach()
    return _DeferrableLinear.apply(
        inputs, weight.detach(), detached_bias, split.anchor, trainable, split
    )


class _RouteLinear(TorchFunctionMode):
    """Inside an overriding ``forward``: send ``F.linear`` on ``layer.weight`` to the split."""

    def __init__(self, layer: nn.Linear, split: WeightGradSplit) -> None:
        super().__init__()
        self.layer = layer
        self.split = split

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            names = ("input", "weight", "bias")
            bound = dict(zip(names, args)) | kwargs
            if bound.get("weight") is self.layer.weight:
                return _deferrable_linear(
                    bound["input"], bound["weight"], bound.get("bias"), self.split
                )
        return func(*args, **kwargs)


class WeightGradSplit:
    """Defers the weight gradients of every ``nn.Linear`` in ``module`` (module docstring).

    Usage by a pipeline executor::

        split = WeightGradSplit(stage_module)
        with split.active():
            out = stage_module(x)                  # F
            with split.deferring(key):
                out.backward(grad)                 # B: input (and non-Linear) gradients
            split.apply(key)                       # W: Linear weight gradients
    """

    def __init__(self, module: nn.Module, partitioned_ok: bool = False) -> None:
        """``partitioned_ok``: ZeRO-3 parameters are allowed because the caller keeps them
        gathered until every W of the batch ran (a pipeline stage gathered for the batch)."""
        self.layers = [m for m in module.modules() if isinstance(m, nn.Linear)]
        for layer in self.layers:
            for name, param in layer.named_parameters(recurse=False):
                if hasattr(param, "ds_shape") and not partitioned_ok:
                    raise ValueError(
                        f"the B/W split of zero-bubble pipeline schedules cannot defer the "
                        f"gradient of a ZeRO-3 partitioned parameter ({type(layer).__name__}."
                        f"{name}) that is released after its backward; keep the stage "
                        "gathered for the batch (pipeline.reshard_after_forward=false), use "
                        "zero_optimization.stage <= 2, or schedule='1f1b'."
                    )
        self.defer_key: Hashable | None = None
        self.anchor = torch.zeros(0, requires_grad=True)  # see _DeferrableLinear
        self._stash: dict[Hashable, list[_Deferred]] = {}
        self._active = False

    # -- installation -------------------------------------------------------------------
    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Route the Linear layers through the split for the duration of the block."""
        if self._active:
            raise RuntimeError("WeightGradSplit.active() is not reentrant")
        saved = [layer.__dict__.get("forward") for layer in self.layers]
        for layer in self.layers:
            layer.forward = self._routed_forward(layer)
        self._active = True
        try:
            yield
        finally:
            self._active = False
            for layer, previous in zip(self.layers, saved):
                del layer.forward
                if previous is not None:
                    layer.forward = previous

    def _routed_forward(self, layer: nn.Linear) -> Callable[..., Any]:
        original = layer.forward  # bound method (or an instance attribute set before us)
        if type(layer).forward is nn.Linear.forward and "forward" not in layer.__dict__:

            def forward(inputs: torch.Tensor) -> torch.Tensor:
                if not torch.is_grad_enabled():
                    return original(inputs)
                return _deferrable_linear(inputs, layer.weight, layer.bias, self)

            return forward

        def routed(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return original(*args, **kwargs)
            with _RouteLinear(layer, self):
                return original(*args, **kwargs)

        return routed

    # -- B and W ------------------------------------------------------------------------
    @contextlib.contextmanager
    def deferring(self, key: Hashable) -> Iterator[None]:
        """Backward passes inside the block keep the Linear weight gradients under ``key``."""
        if self.defer_key is not None:
            raise RuntimeError(f"already deferring weight gradients of {self.defer_key!r}")
        self.defer_key = key
        self._stash.setdefault(key, [])
        try:
            yield
        finally:
            self.defer_key = None

    def stash(self, key: Hashable, item: _Deferred) -> None:
        self._stash.setdefault(key, []).append(item)

    def pending(self) -> list[Hashable]:
        """Keys whose B ran but whose W did not yet."""
        return list(self._stash)

    def stashed_bytes(self) -> int:
        """Bytes held by the stash (inputs and output gradients awaiting W)."""
        return sum(
            t.numel() * t.element_size()
            for items in self._stash.values()
            for item in items
            for t in (item.inputs, item.grad_output)
        )

    @torch.no_grad()
    def _summed_grads(self, items: list[_Deferred]) -> dict[int, tuple[nn.Parameter, torch.Tensor]]:
        """Per parameter (by identity): its weight gradient summed over every deferred call."""
        grads: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}

        def add(param: nn.Parameter, grad: torch.Tensor) -> None:
            grad = grad.to(param.dtype)
            if id(param) in grads:
                grads[id(param)] = (param, grads[id(param)][1] + grad)
            else:
                grads[id(param)] = (param, grad)

        for item in items:
            gw, gb = linear_weight_grads(
                item.inputs, item.grad_output, item.weight is not None, item.bias is not None
            )
            if item.weight is not None and gw is not None:
                add(item.weight, gw)
            if item.bias is not None and gb is not None:
                add(item.bias, gb)
        return grads

    def apply(self, key: Hashable) -> None:
        """W of ``key``: accumulate its deferred weight gradients and drop the stash."""
        items = self._stash.pop(key, None)
        if items is None:
            raise RuntimeError(
                f"weight-gradient pass for {key!r} without a matching input-gradient pass"
            )
        self.accumulate(items)

    def accumulate(self, items: list[_Deferred]) -> None:
        """Compute the weight gradients of ``items`` and accumulate them (``items`` is
        emptied first, so the stashed tensors are freed as early as possible)."""
        grads = self._summed_grads(items)
        items.clear()
        if grads:
            params = [param for param, _ in grads.values()]
            tensors = [grad for _, grad in grads.values()]
            grads.clear()
            # AccumulateGrad of each leaf: sets or adds param.grad, then fires its hooks.
            torch.autograd.backward(params, grad_tensors=tensors)

    def clear(self) -> None:
        """Drop every pending stash (after a failed batch)."""
        self._stash.clear()
        self.defer_key = None

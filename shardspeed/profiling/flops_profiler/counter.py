"""Count the FLOPs and MACs of the ATen ops a model actually runs.

A ``TorchDispatchMode`` sees every op after autograd and decomposition, so what is counted
is what executes (``nn.Linear`` on a 3-D input is one ``addmm``; SDPA is one fused op).

What is counted (FLOPs per op):

* matmul family and convolutions (``mm``, ``addmm``, ``bmm``, ``baddbmm``, convolution):
  PyTorch's own formulas (``torch.utils.flop_counter``), ``2 * m * n * k`` for a matmul.
  MACs = FLOPs / 2. Bias additions fused into ``addmm`` are not counted (as in PyTorch).
* scaled-dot-product attention (all fused kernels, CPU included):
  ``2*B*H*Sq*Sk*D`` for ``Q @ K^T`` plus ``2*B*H*Sq*Sk*Dv`` for ``P @ V``; the causal mask
  does not halve it (same convention as PyTorch and DeepSpeed). Backward kernels: 2x forward.
* elementwise ops (no MACs), following DeepSpeed's flops profiler conventions:
  1 FLOP per output element for arithmetic (add, sub, mul, div, pow, ...), for
  activations (relu, gelu, silu, tanh, sigmoid, ...) and for softmax / log-softmax;
  1 per input element for sum / mean reductions; layer / group / batch norm: 5 per element
  with an affine weight, 4 without.
* not counted: copies, views, indexing, embeddings, comparisons, random number
  generation, losses' gather steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# (args, kwargs, out) -> (flops, macs)
Formula = Callable[[tuple[Any, ...], dict[str, Any], Any], tuple[int, int]]


def _shape(x: Any) -> Any:
    return x.shape if isinstance(x, torch.Tensor) else x


def _torch_formula(packet: Any, fn: Callable[..., int]) -> Formula:
    """Wrap a ``torch.utils.flop_counter`` registry entry; MACs are half the FLOPs."""

    def formula(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> tuple[int, int]:
        flops = int(fn(*args, **kwargs, out_val=out))
        return flops, flops // 2

    return formula


def _sdpa_forward(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> tuple[int, int]:
    q, k, v = (_shape(a) for a in args[:3])
    b, h, s_q, d = q  # (B, H, Sq, D)
    s_k, d_v = k[-2], v[-1]
    macs = b * h * s_q * s_k * d + b * h * s_q * s_k * d_v  # Q@K^T and P@V
    return 2 * macs, macs


def _sdpa_backward(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> tuple[int, int]:
    flops, macs = _sdpa_forward(args[1:4], kwargs, out)  # args[0] is grad_out
    return 2 * flops, 2 * macs


def _numel_out(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    first = out[0] if isinstance(out, (tuple, list)) else out
    return first.numel() if isinstance(first, torch.Tensor) else 0


def _per_output_element(cost: int) -> Formula:
    def formula(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> tuple[int, int]:
        return cost * _numel_out(args, kwargs, out), 0

    return formula


def _per_input_element(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> tuple[int, int]:
    x = args[0]
    return (x.numel() if isinstance(x, torch.Tensor) else 0), 0


def _norm(weight_index: int) -> Formula:
    def formula(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> tuple[int, int]:
        x = args[0]
        weight = args[weight_index] if len(args) > weight_index else kwargs.get("weight")
        return x.numel() * (5 if weight is not None else 4), 0

    return formula


def _build_formulas() -> dict[Any, Formula]:
    formulas: dict[Any, Formula] = {}
    from torch.utils.flop_counter import flop_registry

    for packet, fn in flop_registry.items():
        if isinstance(packet, torch._ops.OpOverloadPacket):
            formulas[packet] = _torch_formula(packet, fn)
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    ):
        if hasattr(aten, name):
            formulas[getattr(aten, name)] = _sdpa_forward
        if hasattr(aten, name + "_backward"):
            formulas[getattr(aten, name + "_backward")] = _sdpa_backward

    pointwise = (
        "add sub mul div rsub neg reciprocal pow sqrt rsqrt exp log log1p tanh sigmoid "
        "relu gelu silu mish leaky_relu elu hardtanh hardswish hardsigmoid softplus "
        "_softmax _safe_softmax _log_softmax"
    ).split()
    for name in pointwise:
        for variant in (name, name + "_"):
            if hasattr(aten, variant):
                formulas[getattr(aten, variant)] = _per_output_element(1)
    for name in ("addcmul", "addcmul_", "addcdiv", "addcdiv_"):
        formulas[getattr(aten, name)] = _per_output_element(2)
    for name in ("sum", "mean"):
        formulas[getattr(aten, name)] = _per_input_element
    formulas[aten.native_layer_norm] = _norm(2)  # (input, normalized_shape, weight, bias, eps)
    formulas[aten.native_group_norm] = _norm(1)  # (input, weight, bias, N, C, HxW, group, eps)
    formulas[aten.native_batch_norm] = _norm(1)  # (input, weight, bias, ...)
    formulas[aten._native_batch_norm_legit] = _norm(1)
    formulas[aten._native_batch_norm_legit_no_training] = _norm(1)
    return formulas


FORMULAS: dict[Any, Formula] = _build_formulas()


def op_cost(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> tuple[int, int]:
    """(FLOPs, MACs) of one executed op; (0, 0) for ops that are not counted."""
    formula = FORMULAS.get(func._overloadpacket)
    if formula is None:
        return 0, 0
    return formula(args, kwargs, out)


_warmed_up = False


def warm_up_dispatch() -> None:
    """Pay PyTorch's one-time cost of a Python dispatch mode (it imports ``torch._dynamo``,
    seconds on a small machine, on the first factory op) outside any timed region."""
    global _warmed_up
    if not _warmed_up:
        with FlopCountMode(lambda *_: None):
            torch.arange(1)
        _warmed_up = True


class FlopCountMode(TorchDispatchMode):
    """Calls ``on_op(op_name, flops, macs)`` for every counted op run inside the mode."""

    def __init__(self, on_op: Callable[[str, int, int], None]) -> None:
        super().__init__()
        self.on_op = on_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        packet = getattr(func, "_overloadpacket", None)
        if packet is None:  # not an ATen overload (e.g. a higher-order op): run uncounted
            return func(*args, **kwargs)
        if packet not in FORMULAS:
            # Composite ops that reach us: count their pieces (as FlopCounterMode does).
            with self:
                result = func.decompose(*args, **kwargs)
            if result is not NotImplemented:
                return result
        out = func(*args, **kwargs)
        flops, macs = op_cost(func, args, kwargs, out)
        if flops or macs:
            self.on_op(packet.__name__, flops, macs)
        return out

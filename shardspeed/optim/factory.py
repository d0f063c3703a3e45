"""Build a torch optimizer from a ds_config ``optimizer`` block.

``build_optimizer("Adam", {"lr": 1e-3, "weight_decay": 0.01}, model.parameters())`` follows
DeepSpeed's mapping (case-insensitive ``type``):

* ``Adam`` -> ``torch.optim.AdamW`` when ``adam_w_mode`` (default true: decoupled weight
  decay), else ``torch.optim.Adam`` (L2 decay added to the gradient). ``AdamW`` is always
  decoupled. ``torch_adam`` is accepted and removed. ``weight_decay`` defaults to 0.0 as
  in DeepSpeed's ``FusedAdam`` (not torch AdamW's 0.01) unless ``torch_adam`` is true.
  With ``offload=True`` the optimizer is :class:`~shardspeed.ops.adam.DeepSpeedCPUAdam`.
* ``OneBitAdam`` / ``ZeroOneAdam`` / ``OneBitLamb`` -> the communication-compressed
  optimizers of :mod:`shardspeed.optim.onebit` (DeepSpeed's parameter names: ``freeze_step``,
  ``var_freeze_step``, ``coeff_beta``, ...); they average gradients themselves
  (``reduces_gradients``).
* ``Muon`` -> :class:`~shardspeed.ops.muon.Muon` (AdamW for the ``use_muon=False``
  groups; DeepSpeed's ``muon_lr``, ``adam_lr``, ``momentum``, ``ns_method``, ...).
* ``Lamb`` -> :class:`~shardspeed.ops.lamb.Lamb`; ``Lion`` -> :class:`~shardspeed.ops.lion.Lion`
  (``DeepSpeedCPULion`` with offload); ``Adagrad`` -> ``torch.optim.Adagrad``
  (``DeepSpeedCPUAdagrad`` with offload); ``SGD`` and any other ``torch.optim`` class name
  -> that class.

The fastest kernel is chosen from the parameters' device (see :mod:`shardspeed.ops.kernels`)
unless ``params`` sets ``fused`` or ``foreach``.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from shardspeed.ops.kernels import default_kernel_flags, materialize, param_tensors
from shardspeed.ops.lamb import Lamb
from shardspeed.ops.lion import Lion

_TORCH_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    name: cls
    for name, cls in vars(torch.optim).items()
    if isinstance(cls, type)
    and issubclass(cls, torch.optim.Optimizer)
    and cls is not torch.optim.Optimizer
}

# DeepSpeed's 1-bit optimizer type names -> class names in shardspeed.optim.onebit (lazy)
_ONEBIT_OPTIMIZERS: dict[str, str] = {
    "onebitadam": "OnebitAdam",
    "zerooneadam": "ZeroOneAdam",
    "onebitlamb": "OnebitLamb",
}

OPTIMIZER_NAMES: tuple[str, ...] = tuple(
    ["Adam", "AdamW", "Lamb", "Lion", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Muon"]
    + sorted(n for n in _TORCH_OPTIMIZERS if n not in ("Adam", "AdamW", "Muon"))
)
"""Built-in ``optimizer.type`` names (matched case-insensitively)."""

_REGISTERED: dict[str, tuple[str, type[torch.optim.Optimizer]]] = {}

# Optimizers whose update of an element reads only that element's grad and state.
_ELEMENTWISE_CLASSES: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.ASGD,
    torch.optim.Rprop,
    torch.optim.Adadelta,
    Lion,
)


def register_optimizer(name: str, optimizer_cls: type[torch.optim.Optimizer]) -> None:
    """Make ``optimizer.type == name`` (case-insensitive) build ``optimizer_cls``.

    Used by optional optimizers (e.g. the 1-bit Adam family) that live outside this module.
    """
    _REGISTERED[name.lower()] = (name, optimizer_cls)


def optimizer_names() -> tuple[str, ...]:
    """All accepted ``optimizer.type`` names: built-ins plus :func:`register_optimizer` ones."""
    return OPTIMIZER_NAMES + tuple(name for name, _ in _REGISTERED.values())


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """True if each element's update depends only on that element's grad and state.

    Such optimizers (Adam, AdamW, SGD, Adagrad, Lion, RMSprop, Adamax, ...) give the same
    result on a flat 1/N shard of concatenated parameters as on the whole tensors. LAMB,
    LARS, Adafactor, Muon, LBFGS and unknown optimizers return False. A class can declare
    itself with a class attribute ``elementwise = True`` (read from the class's own body
    only, so subclasses that change ``step`` must restate it); otherwise a subclass counts
    as elementwise when it keeps the ``step`` of a known elementwise optimizer.
    """
    cls = type(optimizer)
    declared = vars(cls).get("elementwise")
    if isinstance(declared, bool):
        return declared
    step_fn = inspect.unwrap(cls.step)
    return any(step_fn is inspect.unwrap(known.step) for known in _ELEMENTWISE_CLASSES)


def build_optimizer(
    type_name: str,
    params: Mapping[str, Any] | None,
    param_groups: list[dict[str, Any]] | Iterable[Tensor],
    *,
    offload: bool = False,
) -> torch.optim.Optimizer:
    """Construct the optimizer named by ds_config ``optimizer.type`` with ``optimizer.params``.

    Args:
        type_name: ``optimizer.type`` (case-insensitive).
        params: ``optimizer.params``; keys go to the constructor after DeepSpeed's extra keys
            (``torch_adam``, ``adam_w_mode``, ``fp32_optimizer_states``) are consumed.
        param_groups: tensors or torch-style parameter-group dicts.
        offload: the parameters are CPU-resident (ZeRO-Offload); picks the CPU optimizers.

    Raises:
        ValueError: unknown ``type_name``, ``params.max_grad_norm``, or keys the optimizer
            class does not accept (the message lists the accepted keys).
    """
    if not isinstance(type_name, str) or not type_name:
        raise ValueError(
            f"optimizer.type={type_name!r} is invalid; it must be a name such as 'AdamW'. "
            f"Valid names (case-insensitive): {', '.join(optimizer_names())}."
        )
    kwargs = dict(params or {})
    if "max_grad_norm" in kwargs:
        raise ValueError(
            f"optimizer.params.max_grad_norm={kwargs['max_grad_norm']!r} is not supported: "
            "gradient clipping is set by the top-level 'gradient_clipping' key (global norm of "
            "the unscaled gradients). Fix: remove optimizer.params.max_grad_norm and set "
            f'"gradient_clipping": {kwargs["max_grad_norm"]!r} at the top level of the config.'
        )
    cls, kwargs = _resolve(type_name, kwargs, offload)
    _check_kwargs(type_name, cls, kwargs)
    if isinstance(kwargs.get("betas"), list):
        kwargs["betas"] = tuple(kwargs["betas"])
    groups = materialize(param_groups)
    flags: dict[str, bool] = {}
    if "fused" in inspect.signature(cls.__init__).parameters:
        flags = default_kernel_flags(cls, param_tensors(groups), kwargs)
    if flags:
        try:
            return cls(groups, **kwargs, **flags)
        except (RuntimeError, TypeError, ValueError):
            pass  # the fused kernel refused these tensors: let torch pick its default
    try:
        return cls(groups, **kwargs)
    except (RuntimeError, TypeError, ValueError) as err:
        raise ValueError(
            f"optimizer {type_name!r} ({cls.__module__}.{cls.__qualname__}) rejected "
            f"optimizer.params={dict(params or {})!r}: {err}"
        ) from err


def _resolve(
    type_name: str, kwargs: dict[str, Any], offload: bool
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """Map a type name to a class and strip the DeepSpeed-only keys from ``kwargs``."""
    key = type_name.lower()
    if key in ("adam", "adamw"):
        return _resolve_adam(key, kwargs, offload)
    if key == "lamb":
        if kwargs.pop("amsgrad", False):
            raise ValueError("optimizer Lamb: amsgrad=true is not supported; remove the key.")
        return Lamb, kwargs
    if key == "muon":  # masters on the host with offload: it gathers on the device
        from shardspeed.ops.muon import Muon

        return Muon, kwargs
    if key == "lion":
        from shardspeed.ops.lion import DeepSpeedCPULion

        return (DeepSpeedCPULion if offload else Lion), kwargs
    if key in _ONEBIT_OPTIMIZERS:
        if offload:
            raise ValueError(
                f"optimizer.type={type_name!r} cannot run with offload_optimizer: it "
                "communicates from the optimizer step on device-resident masters (as in "
                "DeepSpeed). Fix: remove zero_optimization.offload_optimizer."
            )
        from shardspeed.optim import onebit

        return getattr(onebit, _ONEBIT_OPTIMIZERS[key]), kwargs
    if key == "adagrad" and offload:
        from shardspeed.ops.adagrad import DeepSpeedCPUAdagrad

        return DeepSpeedCPUAdagrad, kwargs
    if key in _REGISTERED:
        return _REGISTERED[key][1], kwargs
    for name, cls in _TORCH_OPTIMIZERS.items():
        if name.lower() == key:
            return cls, kwargs
    hint = difflib.get_close_matches(type_name, optimizer_names(), n=1, cutoff=0.6)
    raise ValueError(
        f"optimizer.type={type_name!r} is not a known optimizer. Valid names "
        f"(case-insensitive): {', '.join(optimizer_names())}."
        + (f" Did you mean {hint[0]!r}?" if hint else "")
    )


def _resolve_adam(
    key: str, kwargs: dict[str, Any], offload: bool
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    torch_adam = bool(kwargs.pop("torch_adam", False))
    adam_w_mode = bool(kwargs.pop("adam_w_mode", True))
    fp32_states = kwargs.pop("fp32_optimizer_states", None)
    decoupled = key == "adamw" or adam_w_mode
    if not torch_adam:
        kwargs.setdefault("weight_decay", 0.0)  # FusedAdam's default, not AdamW's 0.01
    if offload and not torch_adam:
        from shardspeed.ops.adam import DeepSpeedCPUAdam

        kwargs["adamw_mode"] = decoupled
        if fp32_states is not None:
            kwargs["fp32_optimizer_states"] = bool(fp32_states)
        return DeepSpeedCPUAdam, kwargs
    if not torch_adam:
        # FusedAdam-only keys: torch's Adam always bias-corrects and sets grads to None.
        if not kwargs.pop("bias_correction", True):
            raise ValueError(
                "optimizer Adam: bias_correction=false is not supported (torch Adam always "
                "bias-corrects). Fix: remove optimizer.params.bias_correction."
            )
        kwargs.pop("set_grad_none", None)
    return (torch.optim.AdamW if decoupled else torch.optim.Adam), kwargs


def _check_kwargs(type_name: str, cls: type, kwargs: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming every key of ``kwargs`` that ``cls`` does not accept."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())[2:]  # self, params
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    accepted = [p.name for p in parameters if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    unknown = sorted(set(kwargs) - set(accepted))
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, accepted, n=1, cutoff=0.6)
        if close:
            hints.append(f"{key!r} -> {close[0]!r}?")
    raise ValueError(
        f"optimizer {type_name!r} ({cls.__module__}.{cls.__qualname__}) does not accept "
        f"optimizer.params key(s) {unknown}; accepted keys: {accepted}. "
        "Fix: remove or rename them in the ds_config 'optimizer.params' block."
        + (f" Did you mean: {', '.join(hints)}" if hints else "")
    )

"""``optimizer`` and ``scheduler`` blocks.

``optimizer.params`` and ``scheduler.params`` go to the constructors verbatim, so they stay
dicts; this module checks what can be checked up front: the type names (case-insensitive,
normalised to their canonical spelling), scheduler parameter names, required parameters,
the keys DeepSpeed rejects (``max_grad_norm``), and the ranges every optimizer assumes
(``betas`` two numbers in [0, 1), ``eps`` > 0, ``lr`` and ``weight_decay`` >= 0). ``"auto"`` entries in ``params`` are dropped so
the constructor default applies; a required parameter left at ``"auto"`` is an error that says
the caller (e.g. the Hugging Face Trainer) must fill it in.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any

from pydantic import Field

from shardspeed.config.base import (
    ConfigError,
    ConfigModel,
    did_you_mean,
    explain,
    is_auto,
    show,
)
from shardspeed.utils.logging import info_once

DEEPSPEED_OPTIMIZERS = (
    "Adam",
    "AdamW",
    "SGD",
    "Adagrad",
    "Lamb",
    "Lion",
    "OneBitAdam",
    "ZeroOneAdam",
    "OneBitLamb",
    "Muon",
)
"""Optimizer types ShardSpeed implements itself (plus every ``torch.optim`` optimizer)."""

_WARMUP = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"}
SCHEDULER_PARAMS: dict[str, frozenset[str]] = {
    "LRRangeTest": frozenset(
        {
            "lr_range_test_min_lr",
            "lr_range_test_step_size",
            "lr_range_test_step_rate",
            "lr_range_test_staircase",
        }
    ),
    "OneCycle": frozenset(
        {
            "cycle_min_lr",
            "cycle_max_lr",
            "decay_lr_rate",
            "cycle_first_step_size",
            "cycle_second_step_size",
            "cycle_first_stair_count",
            "cycle_second_stair_count",
            "decay_step_size",
            "cycle_momentum",
            "cycle_min_mom",
            "cycle_max_mom",
            "decay_mom_rate",
        }
    ),
    "WarmupLR": frozenset(_WARMUP),
    "WarmupDecayLR": frozenset(_WARMUP | {"total_num_steps"}),
    "WarmupCosineLR": frozenset(
        {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"}
    ),
}
"""Accepted ``scheduler.params`` keys per type (``last_batch_iteration`` is always accepted)."""

VALID_SCHEDULERS = tuple(SCHEDULER_PARAMS)
_REQUIRED = {
    "WarmupDecayLR": ("total_num_steps",),
    "WarmupCosineLR": ("total_num_steps",),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr"),
}
_POSITIVE_INT_PARAMS = ("warmup_num_steps", "total_num_steps")


@functools.cache
def torch_optimizer_names() -> tuple[str, ...]:
    """Names of the optimizer classes in ``torch.optim`` (e.g. ``RMSprop``, ``Muon``)."""
    import torch.optim

    return tuple(
        sorted(
            name
            for name, obj in vars(torch.optim).items()
            if isinstance(obj, type)
            and issubclass(obj, torch.optim.Optimizer)
            and obj is not torch.optim.Optimizer
        )
    )


def supported_optimizer_names() -> tuple[str, ...]:
    """Every accepted ``optimizer.type`` in canonical spelling."""
    extra = [n for n in torch_optimizer_names() if n.lower() not in _lower(DEEPSPEED_OPTIMIZERS)]
    return DEEPSPEED_OPTIMIZERS + tuple(extra)


def _lower(names: tuple[str, ...]) -> set[str]:
    return {n.lower() for n in names}


def _canonical(name: Any, allowed: tuple[str, ...], what: str, key: str = "type") -> str:
    if not isinstance(name, str) or not name.strip():
        raise ConfigError.at(
            key,
            explain(
                f"{what} must be a non-empty string",
                name,
                allowed=", ".join(allowed),
                fix="use one of the allowed names",
            ),
        )
    by_lower = {n.lower(): n for n in allowed}
    found = by_lower.get(name.strip().lower())
    if found is None:
        guess = did_you_mean(name.strip(), allowed)
        raise ConfigError.at(
            key,
            explain(
                f"unknown {what}",
                name,
                allowed=", ".join(allowed),
                fix=f"did you mean '{guess}'?" if guess else "use one of the allowed names",
            ),
        )
    return found


def _drop_auto_params(params: Any, block: str) -> tuple[dict[str, Any], list[str]]:
    if params is None:
        return {}, []
    if not isinstance(params, dict):
        raise ConfigError.at(
            "params", explain("must be a JSON object", params, fix='use "params": {...}')
        )
    autos = [k for k, v in params.items() if is_auto(v)]
    if autos:
        info_once(
            f"ds_config {block}.params: 'auto' values dropped, constructor defaults apply: "
            + ", ".join(autos)
        )
    return {k: v for k, v in params.items() if k not in autos}, autos


class OptimizerConfig(ConfigModel):
    """``optimizer``: which optimizer the engine builds and its constructor arguments."""

    json_key = "optimizer"

    type: str = Field(
        description="Optimizer name, case-insensitive: Adam, AdamW, SGD, Adagrad, Lamb, Lion, "
        "OneBitAdam, ZeroOneAdam, OneBitLamb, Muon, or any torch.optim class. Stored canonically."
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Constructor keyword arguments (lr, betas, eps, weight_decay, "
        "adam_w_mode, torch_adam, ...). 'auto' entries are dropped.",
    )
    legacy_fusion: bool = Field(False, description="Legacy fused-optimizer flag (ignored).")

    @classmethod
    def _preprocess(cls, data: dict[str, Any]) -> dict[str, Any]:
        if "type" in data:
            data["type"] = _canonical(data["type"], supported_optimizer_names(), "optimizer type")
        params, _ = _drop_auto_params(data.get("params"), "optimizer")
        if "max_grad_norm" in params:
            raise ConfigError.at(
                "params.max_grad_norm",
                explain(
                    "is not an optimizer parameter",
                    params["max_grad_norm"],
                    fix=f"use the top-level 'gradient_clipping': {show(params['max_grad_norm'])} "
                    "and remove it from optimizer.params",
                ),
            )
        _check_optimizer_params(params)
        data["params"] = params
        return data


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# (name, lower bound, bound is inclusive, allowed text, example fix) for scalar params
_SCALAR_PARAMS = (
    ("lr", 0.0, True, "a number >= 0", 'use e.g. "lr": 1e-3'),
    ("eps", 0.0, False, "a number > 0", 'use e.g. "eps": 1e-8'),
    ("weight_decay", 0.0, True, "a number >= 0", 'use e.g. "weight_decay": 0.01 (0 to disable)'),
)
_JSON_TYPES = (bool, str, list, tuple, dict, type(None))  # values that cannot be a number


def _check_optimizer_params(params: dict[str, Any]) -> None:
    """Ranges DeepSpeed's and torch's optimizers assume: ``betas`` two numbers in [0, 1),
    ``eps`` > 0, ``lr`` and ``weight_decay`` >= 0. Other objects (a tensor ``lr`` passed
    from Python) are left to the optimizer's constructor."""
    for key, low, inclusive, allowed, fix in _SCALAR_PARAMS:
        if key not in params:
            continue
        value = params[key]
        if _is_number(value):
            ok = value >= low if inclusive else value > low
        else:
            ok = not isinstance(value, _JSON_TYPES)
        if not ok or (_is_number(value) and not math.isfinite(value)):
            problem = "is out of range" if _is_number(value) else "must be a number"
            raise ConfigError.at(f"params.{key}", explain(problem, value, allowed=allowed, fix=fix))
    if "betas" in params:
        betas = params["betas"]
        pair = isinstance(betas, (list, tuple)) and len(betas) == 2
        if not (pair and all(_is_number(b) and 0.0 <= b < 1.0 for b in betas)):
            raise ConfigError.at(
                "params.betas",
                explain(
                    "must be a list of two numbers in [0, 1)",
                    betas,
                    fix='use two decay rates (first and second moment), e.g. "betas": [0.9, 0.999]',
                ),
            )


class SchedulerConfig(ConfigModel):
    """``scheduler``: the learning-rate schedule the engine builds and its arguments."""

    json_key = "scheduler"

    type: str = Field(
        description="One of LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR "
        "(case-insensitive; stored canonically)."
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Constructor keyword arguments of the schedule; 'auto' entries dropped.",
    )

    @classmethod
    def _preprocess(cls, data: dict[str, Any]) -> dict[str, Any]:
        if "type" not in data:
            return data  # pydantic reports the missing key
        kind = _canonical(data["type"], VALID_SCHEDULERS, "scheduler type")
        data["type"] = kind
        params, autos = _drop_auto_params(data.get("params"), "scheduler")
        accepted = SCHEDULER_PARAMS[kind] | {"last_batch_iteration"}
        for key in params:
            if key not in accepted:
                guess = did_you_mean(key, accepted)
                raise ConfigError.at(
                    f"params.{key}",
                    explain(
                        f"unknown parameter for {kind}",
                        params[key],
                        allowed=", ".join(sorted(accepted)),
                        fix=f"did you mean '{guess}'?" if guess else "remove it",
                    ),
                )
        for key in _REQUIRED.get(kind, ()):
            if key not in params:
                note = (
                    ' ("auto" must be replaced by a number before ShardSpeed sees the config; '
                    "the Hugging Face Trainer does this)"
                    if key in autos
                    else ""
                )
                raise ConfigError.at(
                    f"params.{key}",
                    explain(
                        f"is required by the {kind} scheduler{note}",
                        fix=f'add "{key}": <number> to scheduler.params',
                    ),
                )
        for key in _POSITIVE_INT_PARAMS:
            if key in params:
                params[key] = _positive_int(key, params[key])
        if "warmup_type" in params and params["warmup_type"] not in ("log", "linear"):
            raise ConfigError.at(
                "params.warmup_type",
                explain(
                    "unknown warmup type",
                    params["warmup_type"],
                    allowed='"log" or "linear"',
                    fix='use "linear" or "log" (a cosine decay is the WarmupCosineLR type)',
                ),
            )
        data["params"] = params
        return data


def _positive_int(key: str, value: Any) -> int:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok and float(value).is_integer() and value > 0:
        return int(value)
    raise ConfigError.at(
        f"params.{key}",
        explain(
            "must be a positive integer",
            value,
            fix="use a step count >= 1" + (" (for no warmup use 1)" if "warmup" in key else ""),
        ),
    )

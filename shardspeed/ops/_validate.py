"""Argument checks shared by ShardSpeed's own optimizers (messages name the argument)."""

from __future__ import annotations

from collections.abc import Sequence


def check_non_negative(optimizer: str, name: str, value: float) -> None:
    """Raise ``ValueError`` unless ``value`` is a number >= 0."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise ValueError(
            f"{optimizer}: {name}={value!r} is invalid; it must be a number >= 0. "
            f"Fix the '{name}' entry of the optimizer params."
        )


def check_betas(optimizer: str, betas: Sequence[float]) -> tuple[float, float]:
    """Return ``betas`` as a tuple after checking it holds two numbers in [0, 1)."""
    try:
        beta1, beta2 = (float(b) for b in betas)
    except (TypeError, ValueError):
        raise ValueError(
            f"{optimizer}: betas={betas!r} is invalid; it must be two numbers, e.g. [0.9, 0.999]."
        ) from None
    for index, beta in enumerate((beta1, beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(
                f"{optimizer}: betas[{index}]={beta!r} is invalid; each beta must be in [0, 1)."
            )
    return beta1, beta2

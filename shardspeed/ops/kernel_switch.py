"""The environment switches of the CPU kernels (``SHARDSPEED_FASTGEN_GEMV_CPU`` and the like)."""

from __future__ import annotations

import os


def switched_on(env: str, on: str, off: str) -> bool:
    """Whether the switch ``env`` (default on) is on; ``on`` / ``off`` say what each value does,
    for the error an unreadable value gets."""
    value = os.environ.get(env, "1").strip().lower()
    if value not in ("0", "1", "false", "true", "off", "on"):
        raise ValueError(
            f"{env}={value!r} is not understood; set it to 1 ({on}, the default) or 0 ({off})."
        )
    return value in ("1", "true", "on")

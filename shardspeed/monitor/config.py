"""Monitor settings read from a config object or a ds_config dict (duck-typed).

The engine passes its typed config (an object with ``tensorboard``, ``csv_monitor``,
``wandb`` and ``jsonl_monitor`` sub-objects); scripts may pass the raw ds_config dict.
Missing blocks mean "disabled".
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

BACKENDS = ("tensorboard", "csv_monitor", "wandb", "jsonl_monitor")

_DEFAULT_JOB_NAME = "DeepSpeedJobName"
_ALLOWED_KEYS = {
    "tensorboard": {"enabled", "output_path", "job_name"},
    "csv_monitor": {"enabled", "output_path", "job_name"},
    "jsonl_monitor": {"enabled", "output_path", "job_name"},
    "wandb": {"enabled", "group", "team", "project", "job_name", "output_path"},
}


@dataclass(frozen=True)
class BackendSettings:
    """One monitor block (``enabled``, ``output_path``, ``job_name``; wandb extras)."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = _DEFAULT_JOB_NAME
    project: str = "deepspeed"  # wandb
    group: str | None = None  # wandb
    team: str | None = None  # wandb entity


def _block(config: Any, name: str) -> Any:
    if isinstance(config, dict):
        return config.get(name)
    return getattr(config, name, None)


def _settings_from(name: str, block: Any) -> BackendSettings:
    if block is None:
        return BackendSettings()
    if isinstance(block, dict):
        unknown = sorted(set(block) - _ALLOWED_KEYS[name])
        if unknown:
            hint = difflib.get_close_matches(unknown[0], sorted(_ALLOWED_KEYS[name]), n=1)
            raise ValueError(
                f"{name}.{unknown[0]} is not a known key"
                + (f" (did you mean {hint[0]!r}?)" if hint else "")
                + f"; allowed keys: {sorted(_ALLOWED_KEYS[name])}."
            )
        values = dict(block)
    else:
        values = {k: getattr(block, k) for k in _ALLOWED_KEYS[name] if hasattr(block, k)}
    values = {k: v for k, v in values.items() if v is not None}
    return BackendSettings(**values)


def monitor_settings(config: Any) -> dict[str, BackendSettings]:
    """``{backend: BackendSettings}`` for every backend in :data:`BACKENDS`."""
    if config is None:
        return {name: BackendSettings() for name in BACKENDS}
    if not isinstance(config, dict) and not any(hasattr(config, b) for b in BACKENDS):
        # e.g. DeepSpeed's DeepSpeedConfig, whose blocks live under .monitor_config
        inner = getattr(config, "monitor_config", None)
        if inner is not None:
            config = inner
    return {name: _settings_from(name, _block(config, name)) for name in BACKENDS}

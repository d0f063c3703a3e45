"""``init_inference``'s ``moe`` block (DeepSpeed's ``DeepSpeedMoEConfig``), typed and resolved.

DeepSpeed's keys, all accepted: ``moe`` as ``True`` / ``False`` or a dict of
``enabled``, ``ep_size``, ``moe_experts`` (alias ``num_experts``), ``type`` and the
group objects ``ep_group`` (alias ``expert_group``) / ``ep_mp_group``; the deprecated
top-level ``ep_size``, ``moe_experts``, ``moe_type``, ``ep_group``, ``ep_mp_group`` move
into it (with one warning each; a conflicting pair is refused). What each does is in
:mod:`shardspeed.inference.moe_serving`; the two group objects are refused: the
expert groups are the model's own (built by its MoE layers from ``ep_size``).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from shardspeed.config.base import ConfigError, ConfigModel, Int, explain, one_of
from shardspeed.utils.logging import warning_once

MOE_TYPES = ("standard", "residual")
_DEPRECATED = {  # top-level key -> moe.<key>, and its default (unset)
    "ep_size": ("ep_size", 1),
    "moe_experts": ("moe_experts", [1]),
    "moe_type": ("type", "standard"),
    "ep_group": ("ep_group", None),
    "ep_mp_group": ("ep_mp_group", None),
}


class InferenceMoEConfig(ConfigModel):
    """``moe``: serve the model's ``shardspeed.moe`` layers over their expert-parallel group."""

    json_key = "moe"
    key_aliases = {"num_experts": "moe_experts", "expert_group": "ep_group"}

    enabled: bool = Field(True, description="False: the model's MoE layers run untouched.")
    ep_size: Int = Field(1, ge=1, description="Expert-parallel ranks; must be the layers'.")
    moe_experts: list[int] = Field(
        default_factory=lambda: [1], description="Experts per MoE layer ([1]: not checked)."
    )
    type: str = Field(
        "standard", description="'standard' or 'residual' (the layers' use_residual)."
    )
    ep_group: Any = Field(None, description="Refused: the layers' own groups are used.")
    ep_mp_group: Any = Field(None, description="Refused: no expert tensor slicing.")


def resolve_moe_config(cfg: Any) -> InferenceMoEConfig:
    """``cfg.moe`` (bool or dict) with ``cfg``'s deprecated top-level MoE keys merged in;
    :class:`ConfigError` for a bad value, a conflict or a refused key."""
    raw = cfg.moe
    block: dict[str, Any] = {"enabled": raw} if isinstance(raw, bool) else dict(raw or {})
    explicit = bool(raw) if isinstance(raw, bool) else bool(raw)  # a moe block was given
    for old, (new, unset) in _DEPRECATED.items():
        value = getattr(cfg, old)
        if value is None or value == unset:
            continue
        if new in block and block[new] != value:
            raise ConfigError.at(
                old,
                explain(
                    f"conflicts with moe.{new}={block[new]!r}", value,
                    fix=f"keep only moe.{new} ({old} is deprecated)",
                ),
            )  # fmt: skip
        warning_once(f"init_inference: '{old}' is deprecated; use 'moe.{new}'.")
        block[new] = value
        explicit = True
    if not explicit:
        block.setdefault("enabled", False)
    moe = InferenceMoEConfig(**block)
    if moe.type not in MOE_TYPES:
        raise ConfigError.at(
            "moe.type", explain("is not a MoE layer type", moe.type, one_of(MOE_TYPES))
        )
    for key, fix in (
        ("ep_group", "remove it; the MoE layers build their expert groups from ep_size"),
        ("ep_mp_group", "remove it; experts are not tensor-sliced at inference here"),
    ):
        if getattr(moe, key) is not None:
            raise ConfigError.at(
                f"moe.{key}", explain("passing a process group is not supported", True, fix=fix)
            )
    return moe

"""The compression plan: for each enabled technique, its groups, their merged parameters and
the modules (and related modules) they cover in one model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from shardspeed.compression.matching import GroupTarget, match_modules
from shardspeed.config.compression import TECHNIQUES, CompressionConfig


@dataclass
class GroupPlan:
    """One group of one technique, resolved against a model."""

    technique: str
    name: str
    shared: Any
    """The technique's ``shared_parameters`` block."""
    params: Any
    """The group's ``params`` block."""
    targets: list[GroupTarget]
    """Per pattern of ``modules``: the matched modules and their related modules."""

    @property
    def module_names(self) -> list[str]:
        return [name for target in self.targets for name in target.modules]


def plan_technique(model: nn.Module, config: CompressionConfig, technique: str) -> list[GroupPlan]:
    """The groups of one technique resolved against ``model`` (empty when disabled)."""
    block = config.technique(technique)
    if not block.shared_parameters.enabled:
        return []
    taken: set[str] = set()
    plans = []
    for name, group in block.different_groups.items():
        where = f"compression_training.{technique}.different_groups.{name}"
        targets = []
        for i, pattern in enumerate(group.modules):
            modules = match_modules(model, pattern, taken, where)
            related = []
            if group.related_modules is not None:
                related = [
                    match_modules(model, r, None, f"{where}.related_modules")
                    for r in group.related_modules[i]
                ]
            targets.append(GroupTarget(modules, related))
        plans.append(GroupPlan(technique, name, block.shared_parameters, group.params, targets))
    return plans


def plan_all(model: nn.Module, config: CompressionConfig) -> list[GroupPlan]:
    """Every enabled technique's groups, in :data:`TECHNIQUES` order."""
    return [plan for t in TECHNIQUES for plan in plan_technique(model, config, t)]

"""``TorchCheckpointEngine``: checkpoint files through ``torch.save`` / ``torch.load``."""

from __future__ import annotations

import logging
from typing import Any

import torch

from shardspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)
from shardspeed.utils.logging import log_dist

ENGINE_NAME = "TorchCheckpointEngine"


def _zipfile_serialization(config_params: Any) -> bool:
    """DeepSpeed's ``checkpoint.checkpoint_serialization`` (False without a config)."""
    checkpoint_config = getattr(config_params, "checkpoint_config", None)
    if isinstance(checkpoint_config, dict):
        return bool(checkpoint_config.get("checkpoint_serialization", True))
    return False


class TorchCheckpointEngine(CheckpointEngine):
    """Writes each file with ``torch.save`` (zip format when the config's
    ``checkpoint_serialization`` says so) and reads it with ``torch.load``.

    ``load`` unpickles arbitrary objects (``weights_only=False``, as DeepSpeed: its files hold
    argparse namespaces, schedulers, ...): load only checkpoints you trust.
    """

    def __init__(self, config_params: Any = None) -> None:
        super().__init__(config_params)
        self.name = ENGINE_NAME
        self.zipfile_serialization = _zipfile_serialization(config_params)
        log_dist(
            f"[{ENGINE_NAME}] serialization = {self.zipfile_serialization}",
            ranks=[0],
            level=logging.DEBUG,
        )

    def create(self, info: CheckpointCommitInfo) -> None:
        log_dist(f"[{ENGINE_NAME}] saving checkpoint {info.tag}", ranks=[0], level=logging.DEBUG)

    def save(self, state_dict: Any, path: str) -> None:
        torch.save(state_dict, path, _use_new_zipfile_serialization=self.zipfile_serialization)

    def load(self, path: str, map_location: Any = None) -> Any:
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True  # torch.save returned: the files are complete


def create_checkpoint_engine(
    config_params: Any = None,
    groups: Any = None,
    zero_stage: int = 0,
    has_moe_layers: bool = False,
    optimize_dp_state: bool = False,
) -> CheckpointEngine:
    """The checkpoint engine for a config: :class:`TorchCheckpointEngine`.

    DeepSpeed picks its fast, decoupled or DataStates writers from the ``checkpoint`` block;
    ShardSpeed's engine writes its own checkpoints (:mod:`shardspeed.checkpoint`), so this
    factory serves code that only needs a ``torch.save`` engine.
    """
    del groups, zero_stage, has_moe_layers, optimize_dp_state  # for the other writers
    return TorchCheckpointEngine(config_params)


__all__ = ["ENGINE_NAME", "TorchCheckpointEngine", "create_checkpoint_engine"]

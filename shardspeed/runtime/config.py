"""DeepSpeed's ``deepspeed.runtime.config``: ``DeepSpeedConfig`` and ``DeepSpeedConfigError``.

``DeepSpeedConfig(config, mpu=None)`` is a view over the typed
:class:`~shardspeed.config.ShardSpeedConfig` (built by :func:`shardspeed.config.load_config`,
so the same validation and errors apply), with the batch triple resolved for the
data-parallel world as DeepSpeed does and DeepSpeed's attribute names. Any other attribute
is the typed config's (``cfg.zero_optimization.stage``, ``cfg.optimizer``, ...).
"""

from __future__ import annotations

import os
from typing import Any

from shardspeed import comm
from shardspeed.config import ConfigError, ShardSpeedConfig, load_config
from shardspeed.config.zero import ZeroConfig

DeepSpeedConfigError = ConfigError


class DeepSpeedConfig:
    """A ds_config (dict, JSON path or base64 string) resolved for this job."""

    def __init__(
        self,
        config: dict[str, Any] | str | os.PathLike[str] | ShardSpeedConfig,
        mpu: Any = None,
        mesh_device: Any = None,
    ) -> None:
        if comm.is_initialized():
            self.global_rank = comm.get_rank()
            if mpu is not None:
                self.world_size = mpu.get_data_parallel_world_size()
            else:
                self.world_size = comm.get_world_size()
        else:
            self.global_rank, self.world_size = 0, 1
        self.config = load_config(config, dp_world_size=self.world_size)
        self._param_dict = self.config.raw

    def __getattr__(self, name: str) -> Any:
        # only reached for names not set in __init__: the typed config's fields
        config = self.__dict__.get("config")
        if config is None:  # before __init__ ran (copy, unpickling)
            raise AttributeError(name)
        return getattr(config, name)

    # -- DeepSpeed's attribute names that differ from the typed config's ----------------------
    @property
    def zero_optimization_stage(self) -> int:
        return self.config.zero_stage

    @property
    def zero_config(self) -> ZeroConfig:
        return self.config.zero_optimization

    @property
    def bfloat16_enabled(self) -> bool:
        return self.config.bf16_enabled

    @property
    def optimizer_name(self) -> str | None:
        return self.config.optimizer.type.lower() if self.config.optimizer else None

    @property
    def optimizer_params(self) -> dict[str, Any] | None:
        return dict(self.config.optimizer.params) if self.config.optimizer else None

    @property
    def scheduler_name(self) -> str | None:
        return self.config.scheduler.type if self.config.scheduler else None

    @property
    def scheduler_params(self) -> dict[str, Any] | None:
        return dict(self.config.scheduler.params) if self.config.scheduler else None

    def print(self, name: str) -> None:
        """Log the resolved config (DeepSpeed prints it)."""
        from shardspeed.utils.logging import log_dist

        log_dist(f"{name}: {self.config.model_dump_json(indent=2)}", ranks=[0])


__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError"]

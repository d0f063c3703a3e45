"""Typed ds_config: pydantic models for every section, ``load_config`` and ``ConfigError``.

>>> from shardspeed.config import load_config
>>> cfg = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2}},
...                   dp_world_size=2)
>>> (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, cfg.zero_stage)
(4, 1, 2)
"""

from __future__ import annotations

from shardspeed.config.activation_checkpointing import ActivationCheckpointingConfig
from shardspeed.config.base import ConfigError, ConfigIssue, ConfigModel
from shardspeed.config.batch import resolve_batch_triple
from shardspeed.config.checkpoint import AioConfig, CheckpointConfig, ParallelWriteConfig
from shardspeed.config.key_status import KEY_STATUS, KeyRule, KeyStatus, check_key_status
from shardspeed.config.legacy import UNMODELLED_KEYS
from shardspeed.config.loader import load_config, parse_json_text
from shardspeed.config.monitoring import (
    CometConfig,
    CommsLoggerConfig,
    CSVMonitorConfig,
    FlopsProfilerConfig,
    JSONLMonitorConfig,
    MonitorConfig,
    TensorBoardConfig,
    ThroughputTimerConfig,
    TimersConfig,
    WandbConfig,
)
from shardspeed.config.optimizer import (
    DEEPSPEED_OPTIMIZERS,
    VALID_SCHEDULERS,
    OptimizerConfig,
    SchedulerConfig,
    supported_optimizer_names,
)
from shardspeed.config.parallelism import HybridEngineConfig, TensorParallelConfig, TPConfig
from shardspeed.config.pipeline import PipelineConfig
from shardspeed.config.precision import (
    BF16Config,
    DataTypesConfig,
    FP16Config,
    TorchAutocastConfig,
    dtype_from_name,
)
from shardspeed.config.sparse_attention import SparseAttentionConfig
from shardspeed.config.top import ShardSpeedConfig
from shardspeed.config.zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "DEEPSPEED_OPTIMIZERS",
    "KEY_STATUS",
    "UNMODELLED_KEYS",
    "VALID_SCHEDULERS",
    "ActivationCheckpointingConfig",
    "AioConfig",
    "BF16Config",
    "CSVMonitorConfig",
    "CheckpointConfig",
    "CometConfig",
    "CommsLoggerConfig",
    "ConfigError",
    "ConfigIssue",
    "ConfigModel",
    "DataTypesConfig",
    "FP16Config",
    "FlopsProfilerConfig",
    "HybridEngineConfig",
    "JSONLMonitorConfig",
    "KeyRule",
    "KeyStatus",
    "MonitorConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "ParallelWriteConfig",
    "PipelineConfig",
    "SchedulerConfig",
    "ShardSpeedConfig",
    "SparseAttentionConfig",
    "TPConfig",
    "TensorBoardConfig",
    "TensorParallelConfig",
    "ThroughputTimerConfig",
    "TimersConfig",
    "TorchAutocastConfig",
    "WandbConfig",
    "ZeroConfig",
    "check_key_status",
    "dtype_from_name",
    "load_config",
    "parse_json_text",
    "resolve_batch_triple",
    "supported_optimizer_names",
]

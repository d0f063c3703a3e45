"""Logging, profiling and monitoring blocks.

``flops_profiler``, ``tensorboard``, ``wandb``, ``csv_monitor``, ``comet``, our own
``jsonl_monitor`` (one JSON object per event line), ``comms_logger`` and ``timers``.
:class:`MonitorConfig` bundles the monitor back-ends for the monitor factory; it is not a
ds_config key itself (``ShardSpeedConfig.monitor_config`` builds it).
"""

from __future__ import annotations

from pydantic import Field

from shardspeed.config.base import ConfigModel, Float, Int


class FlopsProfilerConfig(ConfigModel):
    """``flops_profiler``: profile one training step (enabling it enables wall_clock_breakdown)."""

    json_key = "flops_profiler"

    enabled: bool = Field(False, description="Profile the model at profile_step.")
    recompute_fwd_factor: Float = Field(
        0.0, ge=0, description="Extra forward passes per step from activation recomputation."
    )
    profile_step: Int = Field(1, ge=1, description="Global step at which to profile.")
    module_depth: Int = Field(-1, description="Depth of the printed module tree (-1 = all).")
    top_modules: Int = Field(1, ge=1, description="Top modules listed per depth.")
    detailed: bool = Field(True, description="Print the per-module breakdown.")
    output_file: str | None = Field(None, description="Write the profile here (None = log).")


class _MonitorBackend(ConfigModel):
    enabled: bool = Field(False, description="Write events to this back-end.")


class TensorBoardConfig(_MonitorBackend):
    """``tensorboard``: event files under ``output_path/job_name``."""

    json_key = "tensorboard"

    output_path: str = Field("", description="Directory for event files ('' = ./runs).")
    job_name: str = Field("DeepSpeedJobName", description="Sub-directory name of this run.")


class CSVMonitorConfig(_MonitorBackend):
    """``csv_monitor``: one ``<tag>.csv`` per tag under ``output_path/job_name``."""

    json_key = "csv_monitor"

    output_path: str = Field("", description="Directory for the CSV files.")
    job_name: str = Field("DeepSpeedJobName", description="Sub-directory name of this run.")


class JSONLMonitorConfig(_MonitorBackend):
    """``jsonl_monitor`` (ShardSpeed addition): ``output_path/job_name/events.jsonl``."""

    json_key = "jsonl_monitor"

    output_path: str = Field("", description="Directory for the JSON-lines file.")
    job_name: str = Field("ShardSpeedJobName", description="Sub-directory name of this run.")


class WandbConfig(_MonitorBackend):
    """``wandb``: Weights & Biases logging."""

    json_key = "wandb"

    group: str | None = Field(None, description="W&B run group.")
    team: str | None = Field(None, description="W&B entity (team).")
    project: str = Field("deepspeed", description="W&B project.")


class CometConfig(_MonitorBackend):
    """``comet``: Comet ML logging."""

    json_key = "comet"

    samples_log_interval: Int = Field(100, ge=1, description="Log every N samples.")
    project: str | None = Field(None, description="Comet project.")
    workspace: str | None = Field(None, description="Comet workspace.")
    api_key: str | None = Field(None, description="Comet API key (prefer the env variable).")
    experiment_name: str | None = Field(None, description="Experiment name.")
    experiment_key: str | None = Field(None, description="Resume this experiment key.")
    online: bool | None = Field(None, description="Log online (None = Comet's default).")
    mode: str | None = Field(None, description='Comet start mode, e.g. "get_or_create".')


class MonitorConfig(ConfigModel):
    """All monitor back-ends together (what the monitor factory consumes)."""

    tensorboard: TensorBoardConfig = Field(
        default_factory=TensorBoardConfig, description="TensorBoard back-end."
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="W&B back-end.")
    csv_monitor: CSVMonitorConfig = Field(
        default_factory=CSVMonitorConfig, description="CSV back-end."
    )
    jsonl_monitor: JSONLMonitorConfig = Field(
        default_factory=JSONLMonitorConfig, description="JSON-lines back-end."
    )
    comet: CometConfig = Field(default_factory=CometConfig, description="Comet back-end.")

    @property
    def enabled(self) -> bool:
        """True if any back-end is enabled."""
        return any(
            block.enabled
            for block in (
                self.tensorboard,
                self.wandb,
                self.csv_monitor,
                self.jsonl_monitor,
                self.comet,
            )
        )


class CommsLoggerConfig(ConfigModel):
    """``comms_logger``: record size and latency of every collective."""

    json_key = "comms_logger"

    enabled: bool = Field(False, description="Record collectives.")
    verbose: bool = Field(False, description="Log every collective as it happens.")
    prof_all: bool = Field(True, description="Record all collectives (else only prof_ops).")
    debug: bool = Field(False, description="Include the calling function in the records.")
    prof_ops: list[str] = Field(
        default_factory=list, description='Collectives to record, e.g. ["all_reduce"].'
    )


class ThroughputTimerConfig(ConfigModel):
    """``timers.throughput``: the samples/sec timer."""

    json_key = "timers.throughput"

    enabled: bool = Field(True, description="Measure training throughput.")
    synchronized: bool = Field(True, description="Synchronize the device before reading time.")


class TimersConfig(ConfigModel):
    """``timers``: engine timers."""

    json_key = "timers"

    throughput: ThroughputTimerConfig = Field(
        default_factory=ThroughputTimerConfig, description="Throughput timer options."
    )

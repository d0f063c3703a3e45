"""``ShardSpeedConfig``: the whole ds_config, typed.

Built once (by :func:`shardspeed.config.load_config`); the runtime reads typed fields and
never the raw dict. An unknown top-level key is ignored, as DeepSpeed ignores it, but never
silently: one warning names it with a "did you mean" (``SHARDSPEED_STRICT_CONFIG=1`` makes it
an error); unknown keys inside a block are errors. The keys ShardSpeed knows but does not
model are listed in :mod:`shardspeed.config.legacy` (warned about or rejected, never dropped
silently). Every accepted key has a status in :mod:`shardspeed.config.key_status` (used,
refused when set to a value that is not implemented, or warned about once when it has no
effect), applied at the end of validation.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BeforeValidator, Field, PrivateAttr, field_validator, model_validator

from shardspeed.config.activation_checkpointing import ActivationCheckpointingConfig
from shardspeed.config.base import ConfigError, ConfigModel, Float, Int, explain, lower_str
from shardspeed.config.batch import BATCH_KEYS, resolve_batch_triple
from shardspeed.config.checkpoint import AioConfig, CheckpointConfig
from shardspeed.config.collective_check import CollectiveCheckConfig
from shardspeed.config.compile import CompileConfig
from shardspeed.config.compression import CompressionConfig
from shardspeed.config.elasticity import ElasticTrainingConfig
from shardspeed.config.key_status import check_key_status
from shardspeed.config.legacy import UNMODELLED_KEYS, split_unknown, split_unmodelled
from shardspeed.config.monitoring import (
    CometConfig,
    CommsLoggerConfig,
    CSVMonitorConfig,
    FlopsProfilerConfig,
    JSONLMonitorConfig,
    MonitorConfig,
    TensorBoardConfig,
    TimersConfig,
    WandbConfig,
)
from shardspeed.config.optimizer import OptimizerConfig, SchedulerConfig
from shardspeed.config.parallelism import HybridEngineConfig, MoEConfig, TensorParallelConfig
from shardspeed.config.pipeline import PipelineConfig
from shardspeed.config.precision import (
    BF16Config,
    DataTypesConfig,
    DTypeName,
    FP16Config,
    TorchAutocastConfig,
    dtype_from_name,
)
from shardspeed.config.sparse_attention import SparseAttentionConfig
from shardspeed.config.zero import ZeroConfig
from shardspeed.utils.logging import warning_once

if TYPE_CHECKING:
    import torch

_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _legacy_zero_bool(data: dict[str, Any]) -> dict[str, Any]:
    """``"zero_optimization": true`` (legacy) => stage 1 (``false`` => stage 0)."""
    value = data.get("zero_optimization")
    if isinstance(value, bool):
        warning_once(
            "ds_config 'zero_optimization': true/false is deprecated; use "
            '"zero_optimization": {"stage": 1} (or 0).'
        )
        block: dict[str, Any] = {"stage": 1 if value else 0}
        if "allgather_size" in data:
            allgather_size = data.pop("allgather_size")
            if value:
                block["allgather_bucket_size"] = allgather_size
        data["zero_optimization"] = block
    return data


def _infinity_is_never(value: Any) -> Any:
    """``float("inf")`` (what Accelerate writes for ``steps_per_print``) means "never"."""
    return None if isinstance(value, float) and value == float("inf") else value


class ShardSpeedConfig(ConfigModel):
    """The typed ds_config. Field names are the ds_config keys."""

    key_aliases = {
        "bfloat16": "bf16",
        "seq_parallel_comm_data_type": "seq_parallel_communication_data_type",
    }

    # -- batch ---------------------------------------------------------------------------------
    train_batch_size: Int | None = Field(
        None, description="Global batch = micro batch * accumulation steps * dp world size."
    )
    train_micro_batch_size_per_gpu: Int | None = Field(
        None, description="Samples per rank per forward/backward."
    )
    gradient_accumulation_steps: Int | None = Field(
        None, description="Micro batches accumulated per optimizer step."
    )
    managed_gradient_accumulation: bool = Field(
        True, description="Engine decides the accumulation boundary (false: every step() steps)."
    )
    elasticity: ElasticTrainingConfig = Field(
        default_factory=ElasticTrainingConfig,
        description="Elastic training: when enabled, the three batch keys above are computed "
        "from this block for the data-parallel world size.",
    )

    # -- logging -------------------------------------------------------------------------------
    steps_per_print: Annotated[Int | None, BeforeValidator(_infinity_is_never)] = Field(
        10,
        ge=0,
        description="Log lr/loss-scale progress every N optimizer steps (0, None or "
        "Infinity = never; Accelerate sets Infinity).",
    )
    wall_clock_breakdown: bool = Field(
        False, description="Time forward/backward/step (forced on by flops_profiler.enabled)."
    )
    memory_breakdown: bool = Field(False, description="Log device memory at each step.")
    dump_state: bool = Field(False, description="Log the engine state after initialize.")
    log_level: Annotated[str | None, BeforeValidator(lower_str)] = Field(
        None, description="Engine log level: debug, info, warning, error or critical."
    )

    # -- gradients -----------------------------------------------------------------------------
    gradient_clipping: Float = Field(
        1.0, ge=0, description="Clip the global gradient norm to this value (0 disables)."
    )
    prescale_gradients: bool = Field(
        False, description="Divide gradients by the dp size before (not after) the reduction."
    )
    gradient_predivide_factor: Float = Field(
        1.0, gt=0, description="Divide gradients by this before the reduction, the rest after."
    )
    gradient_allreduce_op: Annotated[Literal["mean", "sum"], BeforeValidator(lower_str)] = Field(
        "mean", description='Gradient reduction: "mean" or "sum" ("sum" not at ZeRO stage 3).'
    )
    communication_data_type: DTypeName | None = Field(
        None, description="Dtype of gradient reduction; None follows the training dtype."
    )
    seq_parallel_communication_data_type: DTypeName = Field(
        "fp32", description="Dtype of sequence-parallel gradient communication."
    )
    sparse_gradients: bool = Field(
        False, description="Reduce embedding gradients as sparse tensors (legacy)."
    )
    disable_allgather: bool = Field(False, description="Legacy flag (accepted, unused).")

    # -- optimizer policy ----------------------------------------------------------------------
    zero_allow_untested_optimizer: bool = Field(
        False, description="Allow a client optimizer that is not a tested one with ZeRO."
    )
    zero_force_ds_cpu_optimizer: bool = Field(
        True, description="With CPU offload, require ShardSpeed's CPU optimizer."
    )
    optimizer: OptimizerConfig | None = Field(
        None, description="Optimizer built by the engine (None: pass one to initialize)."
    )
    scheduler: SchedulerConfig | None = Field(
        None, description="LR schedule built by the engine (None: none or the client's)."
    )

    # -- precision -----------------------------------------------------------------------------
    fp16: FP16Config = Field(default_factory=FP16Config, description="fp16 mixed precision.")
    bf16: BF16Config = Field(
        default_factory=BF16Config, description="bf16 mixed precision (alias: bfloat16)."
    )
    data_types: DataTypesConfig = Field(
        default_factory=DataTypesConfig, description="Dtypes of accumulation/params/buffers."
    )
    torch_autocast: TorchAutocastConfig = Field(
        default_factory=TorchAutocastConfig, description="torch.autocast-based precision."
    )
    initial_zero_grad_step: Literal["deepspeed", "none"] = Field(
        "deepspeed",
        description="ShardSpeed option (not a DeepSpeed key). At ZeRO stage 0 with bf16/fp16 "
        "parameters, 'deepspeed' reproduces DeepSpeed 0.19.8: the engine steps the optimizer "
        "once with all-zero gradients when it is built (Adam's step count starts at 1, so its "
        "first real update is about 0.74 lr; weight decay moves the fp32 masters once). "
        "Not with a bf16 pipeline, as in DeepSpeed. 'none' skips that step.",
    )

    # -- sharding and parallelism --------------------------------------------------------------
    zero_optimization: ZeroConfig = Field(
        default_factory=ZeroConfig, description="ZeRO sharding (legacy true => stage 1)."
    )
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig, description="Activation checkpointing."
    )
    pipeline: PipelineConfig = Field(
        default_factory=PipelineConfig, description="Pipeline parallelism."
    )
    tensor_parallel: TensorParallelConfig = Field(
        default_factory=TensorParallelConfig, description="AutoTP training."
    )
    hybrid_engine: HybridEngineConfig = Field(
        default_factory=HybridEngineConfig, description="Train + generate engine (RLHF)."
    )
    moe: MoEConfig = Field(default_factory=MoEConfig, description="MoE training options.")
    compile: CompileConfig = Field(
        default_factory=CompileConfig,
        description="Compiled training step: torch.compile of the model's forward (stages 0-2).",
    )
    compression_training: CompressionConfig = Field(
        default_factory=CompressionConfig,
        description="Compression during training (shardspeed.compression: init_compression "
        "wraps the layers, the engine steps the compression scheduler).",
    )
    sequence_parallel_size: Int | None = Field(
        None, ge=1, description="Ulysses sequence-parallel degree."
    )
    data_parallel_size: Int | None = Field(
        None, ge=1, description="Data-parallel degree of the DP x SP mesh."
    )
    use_data_before_expert_parallelism: bool = Field(
        False, description="Order data-parallel before expert-parallel ranks in the mesh."
    )
    sparse_attention: SparseAttentionConfig | None = Field(
        None, description="Block-sparse attention layout (None = not configured)."
    )
    vocabulary_size: Int | None = Field(
        None, ge=1, description="Vocabulary size (warns if not a multiple of 8)."
    )

    # -- monitoring and profiling --------------------------------------------------------------
    flops_profiler: FlopsProfilerConfig = Field(
        default_factory=FlopsProfilerConfig, description="FLOPs profiler."
    )
    comms_logger: CommsLoggerConfig = Field(
        default_factory=CommsLoggerConfig, description="Collective-communication logger."
    )
    tensorboard: TensorBoardConfig = Field(
        default_factory=TensorBoardConfig, description="TensorBoard monitor."
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="W&B monitor.")
    csv_monitor: CSVMonitorConfig = Field(
        default_factory=CSVMonitorConfig, description="CSV monitor."
    )
    jsonl_monitor: JSONLMonitorConfig = Field(
        default_factory=JSONLMonitorConfig, description="JSON-lines monitor (ShardSpeed)."
    )
    comet: CometConfig = Field(default_factory=CometConfig, description="Comet monitor.")
    timers: TimersConfig = Field(default_factory=TimersConfig, description="Engine timers.")
    collective_check: CollectiveCheckConfig = Field(
        default_factory=CollectiveCheckConfig,
        description="Compare ranks' collective sequences every N steps (ShardSpeed debug aid).",
    )

    # -- checkpointing and I/O -----------------------------------------------------------------
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpoint save/load options."
    )
    aio: AioConfig = Field(default_factory=AioConfig, description="Async NVMe I/O options.")
    dataloader_drop_last: bool = Field(
        False, description="Drop the last incomplete batch in the engine's data loader."
    )
    disable_python_gc: bool = Field(
        False, description="Disable Python's cyclic GC during training (collect at safe points)."
    )

    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)
    _ignored: dict[str, Any] = PrivateAttr(default_factory=dict)
    _given_batch: tuple[int | None, int | None, int | None] = PrivateAttr(
        default=(None, None, None)
    )
    _dp_world_size: int | None = PrivateAttr(default=None)

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def known_keys(cls) -> set[str]:
        """Modelled keys plus the accepted-but-unmodelled ones (for "did you mean")."""
        return super().known_keys() | set(UNMODELLED_KEYS)

    @model_validator(mode="wrap")
    @classmethod
    def _capture_raw(cls, data: Any, handler: Any) -> Any:
        if not isinstance(data, dict):
            return handler(data)
        raw = copy.deepcopy(data)
        rest, ignored = split_unmodelled(data)
        rest, unknown = split_unknown(cls, rest)
        ignored.update(unknown)
        config = handler(rest)
        config._raw = raw
        config._ignored = ignored
        config._given_batch = (
            config.train_batch_size,
            config.train_micro_batch_size_per_gpu,
            config.gradient_accumulation_steps,
        )
        return config

    @classmethod
    def _preprocess(cls, data: dict[str, Any]) -> dict[str, Any]:
        return _legacy_zero_bool(data)

    @field_validator(
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
    )
    @classmethod
    def _positive_batch(cls, value: int | None) -> int | None:
        if value is not None and value <= 0:
            raise ValueError(
                explain("must be a positive integer", value, fix="use a value >= 1 or remove it")
            )
        return value

    @field_validator("log_level")
    @classmethod
    def _check_log_level(cls, value: str | None) -> str | None:
        if value is not None and value not in _LOG_LEVELS:
            raise ValueError(explain("unknown log level", value, allowed=", ".join(_LOG_LEVELS)))
        return value

    @model_validator(mode="after")
    def _check(self) -> ShardSpeedConfig:
        stage = self.zero_optimization.stage
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError.at(
                "bf16.enabled",
                explain(
                    "fp16 and bf16 cannot both be enabled",
                    True,
                    fix="set fp16.enabled or bf16.enabled to false (prefer bf16 where the "
                    "hardware supports it)",
                ),
            )
        needs_zero = (
            ("fp16.fp16_master_weights_and_grads", self.fp16.fp16_master_weights_and_grads),
            ("bf16.bf16_master_weights_and_grads", self.bf16.bf16_master_weights_and_grads),
            ("bf16.bf16_optimizer_states", self.bf16.bf16_optimizer_states),
        )
        for key, value in needs_zero:
            if value and stage == 0:
                raise ConfigError.at(
                    key,
                    explain(
                        "needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is 0)",
                        True,
                        fix='set "zero_optimization": {"stage": 1} or higher, or drop the key',
                    ),
                )
        if self.gradient_allreduce_op == "sum" and stage == 3:
            raise ConfigError.at(
                "gradient_allreduce_op",
                explain(
                    '"sum" is not supported with ZeRO stage 3',
                    "sum",
                    fix='use "mean" or ZeRO stage 0-2',
                ),
            )
        if self.elasticity.enabled:  # the block computes the batch keys per world size
            given = {k: getattr(self, k) for k in BATCH_KEYS if getattr(self, k) is not None}
            self.elasticity.check_batch_keys(given)
            for key in given:
                setattr(self, key, None)
        if self.flops_profiler.enabled:
            self.wall_clock_breakdown = True
        if self.vocabulary_size is not None and self.vocabulary_size % 8 != 0:
            warning_once(
                f"ds_config vocabulary_size {self.vocabulary_size} is not a multiple of 8; "
                "padding it to one uses tensor cores better."
            )
        check_key_status(self)  # last: refuse unimplemented features, warn about no-op knobs
        return self

    # -- batch resolution ----------------------------------------------------------------------

    def resolve_batch(self, dp_world_size: int) -> ShardSpeedConfig:
        """Return a copy with the batch triple resolved for ``dp_world_size`` (all ints).

        Resolution starts from the values the user gave, so a resolved config can be
        re-resolved for another world size. With elasticity enabled the triple comes from the
        ``elasticity`` block for this world size instead.
        """
        given = self._given_batch
        if self.elasticity.enabled:
            given = self.elasticity.batch_for(dp_world_size)
        tbs, micro, gas = resolve_batch_triple(*given, dp_world_size)
        resolved = self.model_copy(
            deep=True,
            update={
                "train_batch_size": tbs,
                "train_micro_batch_size_per_gpu": micro,
                "gradient_accumulation_steps": gas,
            },
        )
        resolved._dp_world_size = dp_world_size
        return resolved

    @property
    def batch_resolved(self) -> bool:
        """True once the three batch values are known (after ``resolve_batch``)."""
        return self._dp_world_size is not None

    @property
    def dp_world_size(self) -> int | None:
        """The data-parallel world size the batch was resolved for (None if unresolved)."""
        return self._dp_world_size

    # -- convenience views ---------------------------------------------------------------------

    @property
    def raw(self) -> dict[str, Any]:
        """The user's dict as given (after JSON parsing), for checkpoints and logging."""
        return self._raw

    @property
    def activation_checkpointing_given(self) -> bool:
        """True when the user gave an ``activation_checkpointing`` block (even ``{}``).

        DeepSpeed configures activation checkpointing from the config only when the block
        is present; otherwise ``shardspeed.checkpointing.configure`` keeps its own settings.
        """
        return "activation_checkpointing" in self.model_fields_set

    @property
    def ignored_keys(self) -> dict[str, Any]:
        """Top-level keys accepted without effect (see ``shardspeed.config.legacy``)."""
        return self._ignored

    @property
    def fp16_enabled(self) -> bool:
        """``fp16.enabled``."""
        return self.fp16.enabled

    @property
    def bf16_enabled(self) -> bool:
        """``bf16.enabled``."""
        return self.bf16.enabled

    @property
    def zero_stage(self) -> int:
        """``zero_optimization.stage`` (0-3)."""
        return self.zero_optimization.stage

    @property
    def zero_enabled(self) -> bool:
        """True for ZeRO stages 1-3."""
        return self.zero_optimization.stage > 0

    @property
    def monitor_config(self) -> MonitorConfig:
        """The monitor back-end blocks bundled for the monitor factory."""
        return MonitorConfig(
            tensorboard=self.tensorboard,
            wandb=self.wandb,
            csv_monitor=self.csv_monitor,
            jsonl_monitor=self.jsonl_monitor,
            comet=self.comet,
        )

    def communication_dtype(self) -> torch.dtype | None:
        """``communication_data_type`` as a ``torch.dtype`` (None: follow the training dtype)."""
        return dtype_from_name(self.communication_data_type)

    def train_dtype(self) -> torch.dtype:
        """Parameter/compute dtype implied by the precision blocks (bf16, fp16, else fp32)."""
        import torch

        if self.bf16.enabled:
            return torch.bfloat16
        if self.fp16.enabled:
            return torch.float16
        return torch.float32

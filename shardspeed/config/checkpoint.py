"""``checkpoint`` and ``aio`` (asynchronous NVMe I/O) blocks."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from shardspeed.config.base import ConfigModel, Int


def _tag_mode(value: Any) -> Any:
    if isinstance(value, str):
        return value.strip().capitalize()
    return value


class ParallelWriteConfig(ConfigModel):
    """``checkpoint.parallel_write``."""

    json_key = "checkpoint.parallel_write"

    pipeline_stage: bool = Field(
        False, description="Each pipeline stage writes its own layers in parallel."
    )


class CheckpointConfig(ConfigModel):
    """``checkpoint``: save/load behaviour."""

    json_key = "checkpoint"

    tag_validation: Annotated[Literal["Ignore", "Warn", "Fail"], BeforeValidator(_tag_mode)] = (
        Field(
            "Warn",
            description="What to do when ranks disagree on the checkpoint tag "
            "(Ignore/Warn/Fail, case-insensitive).",
        )
    )
    load_universal: bool = Field(
        False,
        description="load_checkpoint reads a DeepSpeed universal checkpoint folder (made by "
        "ds_to_universal; tag from 'latest_universal') instead of a ZeRO checkpoint, at any "
        "world size and ZeRO stage.",
    )
    layout: Literal["auto", "native", "deepspeed"] = Field(
        "auto",
        description="ShardSpeed: 'deepspeed' makes save_checkpoint also write DeepSpeed "
        "0.19's files (mp_rank_00_model_states.pt, zero_pp_rank_*_optim_states.pt) into each "
        "tag, readable by DeepSpeed's load_checkpoint, zero_to_fp32 and PyTorch Lightning "
        "(ZeRO 1-3, fp32/bf16, data parallelism only). 'native': ShardSpeed's files only. "
        "'auto' (default): 'deepspeed' where that layout holds the engine's state and the job "
        "runs through the compatibility distribution (import deepspeed), else 'native'.",
    )
    use_node_local_storage: bool = Field(
        False, description="Each node writes to local storage (not a shared filesystem)."
    )
    parallel_write: ParallelWriteConfig = Field(
        default_factory=ParallelWriteConfig, description="Parallel write options."
    )
    checkpoint_serialization: bool = Field(
        True, description="Serialize tensors into one file per rank (torch.save format)."
    )
    writer: dict[str, Any] | None = Field(
        None,
        description="Checkpoint writer options (type, io_buffer_size, ...); DeepSpeed's "
        "'decoupled': true turns on async_save.",
    )
    async_save: bool = Field(
        False,
        description="ShardSpeed: save_checkpoint copies every tensor to host memory and "
        "returns; a background thread writes the files and publishes the tag once every rank "
        "finished. The next save, a load, engine.wait_checkpoint() and engine.destroy() wait "
        "for it and raise if it failed.",
    )

    fsync: bool = Field(
        True,
        description="ShardSpeed: fsync every rank file before the tag is published, so a "
        "published checkpoint survives a power loss or kernel crash, not only a killed "
        "process. false saves faster and is only as durable as the page cache.",
    )

    @property
    def async_enabled(self) -> bool:
        """``async_save``, or DeepSpeed's ``writer.decoupled`` (its asynchronous writer)."""
        return self.async_save or bool((self.writer or {}).get("decoupled", False))


class AioConfig(ConfigModel):
    """``aio``: asynchronous I/O used by NVMe offload."""

    json_key = "aio"
    key_aliases = {"thread_count": "intra_op_parallelism"}

    block_size: Int = Field(1048576, ge=1, description="Bytes per I/O request.")
    queue_depth: Int = Field(8, ge=1, description="Outstanding I/O requests.")
    intra_op_parallelism: Int = Field(
        1, ge=1, description="I/O threads per operation (DeepSpeed docs call it thread_count)."
    )
    single_submit: bool = Field(False, description="Submit requests one at a time.")
    overlap_events: bool = Field(True, description="Overlap submission and completion.")
    use_gds: bool = Field(False, description="Use GPUDirect Storage.")

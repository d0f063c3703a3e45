"""``shardspeed.initialize``: DeepSpeed's entry point, returning the engine and friends."""

from __future__ import annotations

import argparse
from typing import Any

import torch.nn as nn

from shardspeed import comm
from shardspeed.config import ShardSpeedConfig, load_config
from shardspeed.topology import Topology


def _pick_config(args: Any, config: Any, config_params: Any) -> Any:
    if config is None:
        config = config_params
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None) or getattr(
            args, "deepscale_config", None
        )
    if from_args is not None and config is not None:
        raise ValueError(
            "a config was given both as args.deepspeed_config and as config=; pass only one "
            "(remove --deepspeed_config or the config= argument)."
        )
    config = config if config is not None else from_args
    if config is None:
        raise ValueError(
            "shardspeed.initialize needs a config: pass config=<dict | path to JSON | base64 "
            "string>, or args with --deepspeed_config PATH."
        )
    return config


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[Any, Any, Any, Any]:
    """Wrap ``model`` for training; returns ``(engine, optimizer, dataloader, lr_scheduler)``.

    ``optimizer`` may be a torch optimizer, a callable building one from parameter groups,
    or None (then the config's ``optimizer`` block is used). ``lr_scheduler`` likewise.
    ``training_data`` (a Dataset) gives a distributed dataloader of micro-batches.
    """
    if model is None:
        raise ValueError("shardspeed.initialize requires model=<torch.nn.Module>.")
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if mesh_param is not None:
        raise ValueError(
            "mesh_param is not supported; describe the layout with the config's parallel "
            "degrees (pipeline / tensor_parallel) instead."
        )
    raw_config = _pick_config(args, config, config_params)
    if dist_init_required is not False and not comm.is_initialized():
        comm.init_distributed(distributed_port=distributed_port)

    from shardspeed.zero import construct
    from shardspeed.zero.tensor_fragment import link_engine

    with construct.paused():  # like DeepSpeed, an active zero.Init is suspended here
        result = _build_engine(
            model,
            raw_config,
            optimizer=optimizer,
            model_parameters=model_parameters,
            training_data=training_data,
            lr_scheduler=lr_scheduler,
            mpu=mpu,
            collate_fn=collate_fn,
        )
    link_engine(result[0])  # parameter -> engine back-reference for the safe_get_* utilities
    return result


def _build_engine(
    model: nn.Module,
    raw_config: Any,
    *,
    optimizer: Any,
    model_parameters: Any,
    training_data: Any,
    lr_scheduler: Any,
    mpu: Any,
    collate_fn: Any,
) -> tuple[Any, Any, Any, Any]:
    # --- pipeline parallelism (issue 7): a PipelineModule gets the PipelineEngine ---------
    from shardspeed.runtime.pipe.module import PipelineModule
    from shardspeed.zero.init_partition import materialize_init_params

    if isinstance(model, PipelineModule):
        from shardspeed.runtime.pipe.engine import initialize_pipeline

        materialize_init_params(model, "pipeline parallelism does not shard parameters")
        autotp = load_config(raw_config).tensor_parallel.autotp_size
        if autotp > 1:
            raise ValueError(
                f"tensor_parallel.autotp_size={autotp} with a PipelineModule: AutoTP shards a "
                "Hugging Face model, not pipeline layers. Build the PipelineModule's layers "
                "from ColumnParallelLinear / RowParallelLinear (group=topology.group('tensor')) "
                "and pass topology=Topology.build(pp=..., tp=...) (or a "
                "PipeModelDataParallelTopology); remove autotp_size from the config."
            )
        return initialize_pipeline(
            model,
            raw_config,
            optimizer=optimizer,
            model_parameters=model_parameters,
            lr_scheduler=lr_scheduler,
            mpu=mpu,
            training_data=training_data,
            collate_fn=collate_fn,
        )
    # --- end pipeline hook -------------------------------------------------------------------

    cfg = load_config(raw_config)
    tp = tensor_parallel_size(cfg, model)
    topology = build_topology(cfg, mpu, tp)
    if tp > 1:
        shard_for_tensor_parallelism(model, cfg, topology)
    cfg = cfg.resolve_batch(topology.size("data"))  # the batch triple counts data ranks only

    from shardspeed.runtime.engine import ShardSpeedEngine

    engine = ShardSpeedEngine(
        model,
        cfg,
        topology,
        optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=lr_scheduler,
        mpu=mpu,
    )
    dataloader = None
    if training_data is not None:
        dataloader = engine.deepspeed_io(training_data, collate_fn=collate_fn)
        engine.training_dataloader = dataloader
    return engine, engine.optimizer, dataloader, engine.lr_scheduler


def build_topology(config: ShardSpeedConfig, mpu: Any = None, tp: int = 1) -> Topology:
    """The job's device mesh: from a Megatron/DeepSpeed-style ``mpu`` when one is given,
    otherwise from the parallel degrees (``tp`` from AutoTP, ``sequence_parallel_size``).
    Built once per layout and world group, then reused (kept in
    :data:`~shardspeed.parallel.topology_cache.TOPOLOGIES`, where ``deepspeed.utils.groups``
    finds it); the tensor- and sequence-parallel layers are handed the same mesh."""
    from shardspeed.parallel.topology_cache import TOPOLOGIES

    if mpu is not None:
        topology = Topology.from_mpu(mpu)
        TOPOLOGIES.set_job(topology)
        return topology
    sp = config.sequence_parallel_size or 1
    return TOPOLOGIES.job_topology(tp, sp, lambda: _mesh(tp, sp))


def _mesh(tp: int, sp: int) -> Topology:
    from shardspeed.parallel.sequence import groups as sequence_groups
    from shardspeed.parallel.tensor import groups as tensor_groups

    if sp == 1 and tp > 1:
        return tensor_groups.topology_for(tp)  # the mesh a tp_model_init model already uses
    topology = Topology.build(tp=tp, sp=sp)
    if tp > 1:
        tensor_groups.register_topology(topology)
    if sp > 1:
        sequence_groups.register_topology(topology)
    return topology


def tensor_parallel_size(config: ShardSpeedConfig, model: nn.Module) -> int:
    """AutoTP degree: ``tensor_parallel.autotp_size``, or the ``tp_model_init`` plan's."""
    plan = getattr(model, "shardspeed_tp", None)
    configured = config.tensor_parallel.autotp_size
    if plan is None:
        return max(configured, 1)
    if configured > 1 and configured != plan.tp_size:
        raise ValueError(
            f"tensor_parallel.autotp_size={configured} but the model was sharded by "
            f"tp_model_init(tp_size={plan.tp_size}); set autotp_size to {plan.tp_size} or "
            "remove it."
        )
    return plan.tp_size


def shard_for_tensor_parallelism(
    model: nn.Module, config: ShardSpeedConfig, topology: Topology
) -> None:
    """Shard ``model`` in place with AutoTP (unless ``tp_model_init`` already did).

    Any ZeRO stage composes: ZeRO shards each tensor rank's (already split) parameters over
    the data axis only.
    """
    if getattr(model, "shardspeed_tp", None) is not None:
        return
    from shardspeed.parallel.tensor.autotp import tp_model_init

    tp_config = config.tensor_parallel
    tp_model_init(
        model,
        topology.size("tensor"),
        None,  # the engine casts to the training dtype
        topology.group("tensor"),
        partition_config=tp_config.partition_config,
        preset_model=tp_config.preset_model,
    )


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--deepspeed``, ``--deepspeed_config`` (and the deprecated deepscale names)."""
    group = parser.add_argument_group("ShardSpeed", "ShardSpeed (DeepSpeed-compatible) options")
    group.add_argument("--deepspeed", default=False, action="store_true", help="Enable ShardSpeed.")
    group.add_argument("--deepspeed_config", default=None, type=str, help="ds_config JSON path.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser

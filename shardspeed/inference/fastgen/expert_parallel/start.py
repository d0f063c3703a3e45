"""Decide whether an engine runs expert-parallel, refuse what cannot, spawn the workers."""

from __future__ import annotations

from typing import Any

import torch

from shardspeed.inference.fastgen.config import EngineConfig
from shardspeed.inference.fastgen.expert_parallel.attach import num_experts_of
from shardspeed.inference.fastgen.expert_parallel.dispatch import DISPATCHES
from shardspeed.inference.fastgen.expert_parallel.peers import ExpertParallelPeers
from shardspeed.inference.fastgen.expert_parallel.placement import check_expert_layout
from shardspeed.inference.fastgen.loader import (
    checkpoint_source,
    describe_source,
    meta_model,
    parse_dtype,
)
from shardspeed.inference.fastgen.models import RaggedModel, get_model_class
from shardspeed.inference.fastgen.tensor_parallel.peers import worker_devices


def check_config(config: EngineConfig, device: torch.device) -> None:
    """``ValueError`` for engine options that do not combine with ``expert_parallel > 1``."""
    ep = config.expert_parallel
    if config.compile_decode not in (None, False):
        raise ValueError(
            f"EngineConfig.compile_decode={config.compile_decode!r} with expert_parallel={ep} "
            "is not supported (the compiled step has no all-to-all); use compile_decode=False "
            "or expert_parallel=1."
        )
    if config.offload is not None:
        raise ValueError(
            f"EngineConfig.offload={config.offload.device!r} with expert_parallel={ep} is not "
            "supported yet; use expert_parallel=1 or no offload."
        )
    dispatch = config.expert_parallel_dispatch
    if dispatch not in DISPATCHES:
        raise ValueError(
            f"EngineConfig.expert_parallel_dispatch={dispatch!r} is not supported; choose one of "
            f"{sorted(DISPATCHES)}."
        )
    worker_devices(device, ep)  # enough CUDA devices


def expert_count(model_or_path: Any, ep: int) -> int:
    """Routed experts per layer of ``model_or_path``; ``ValueError`` for a model that cannot
    be split by experts (built on the meta device, nothing loaded)."""
    if isinstance(model_or_path, RaggedModel):
        raise ValueError(
            f"EngineConfig.expert_parallel={ep} needs the checkpoint to split at load, but got "
            f"an already-built {type(model_or_path).__name__}; pass its HF directory or "
            "transformers model instead, or use expert_parallel=1."
        )
    config, _, _ = describe_source(model_or_path)
    cls = get_model_class(config.get("model_type"))
    if not hasattr(cls, "place_experts"):
        raise ValueError(
            f"EngineConfig.expert_parallel={ep}: model_type={config.get('model_type')!r} "
            f"({cls.__name__}) has no routed experts to place; expert parallelism serves "
            "mixtral, qwen2_moe and qwen3_moe. Use expert_parallel=1 (or tensor_parallel)."
        )
    return num_experts_of(meta_model(cls, config))


def start_expert_parallel(
    model_or_path: Any, config: EngineConfig, device: torch.device
) -> ExpertParallelPeers | None:
    """None for ``expert_parallel == 1``; else validated, spawned workers loading their experts.

    Every refusal (options, model family, experts not divisible, devices) happens
    here, before any process starts.
    """
    ep = config.expert_parallel
    if ep == 1:
        return None
    check_config(config, device)
    num_experts = expert_count(model_or_path, ep)
    check_expert_layout(num_experts, ep, where="EngineConfig.expert_parallel")
    source = checkpoint_source(model_or_path)
    dtype = parse_dtype(config.dtype)
    return ExpertParallelPeers.spawn_experts(
        source, num_experts, ep, dtype, device, config.quantization,
        config.expert_parallel_dispatch, config.cpu_prepack,
    )  # fmt: skip

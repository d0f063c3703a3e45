"""Decide whether an engine runs tensor-parallel, refuse what cannot, spawn the workers."""

from __future__ import annotations

from typing import Any

import torch

from shardspeed.inference.fastgen.config import EngineConfig
from shardspeed.inference.fastgen.loader import check_shardable, checkpoint_source, parse_dtype
from shardspeed.inference.fastgen.tensor_parallel.peers import TensorParallelPeers, worker_devices


def check_config(config: EngineConfig, device: torch.device) -> None:
    """``ValueError`` for engine options that do not combine with ``tensor_parallel > 1``."""
    tp = config.tensor_parallel
    if config.compile_decode not in (None, False):
        raise ValueError(
            f"EngineConfig.compile_decode={config.compile_decode!r} with tensor_parallel={tp} is "
            "not supported (the compiled step has no all-reduce); use compile_decode=False or "
            "tensor_parallel=1."
        )
    worker_devices(device, tp)  # enough CUDA devices


def start_tensor_parallel(
    model_or_path: Any, config: EngineConfig, device: torch.device
) -> TensorParallelPeers | None:
    """None for ``tensor_parallel == 1``; else validated, spawned workers loading their shards.

    Every refusal (options, model family, head/MLP divisibility, quantization groups that
    a rank's columns would cut, devices) happens here, before any process starts.
    """
    if config.tensor_parallel == 1:
        return None
    check_config(config, device)
    check_shardable(model_or_path, config.tensor_parallel, config.quantization)
    source = checkpoint_source(model_or_path)
    dtype = parse_dtype(config.dtype)
    return TensorParallelPeers.spawn(
        source, config.tensor_parallel, dtype, device, config.quantization, config.cpu_prepack
    )

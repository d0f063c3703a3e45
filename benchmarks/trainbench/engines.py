"""Engine adapters: wrap the workload's model in one engine and expose ``train_step``.

Each adapter owns one training engine (PyTorch DDP, PyTorch FSDP2, DeepSpeed, shardspeed)
and turns ``(inputs, targets)`` into one optimizer step, returning the detached loss.
The model, data, optimizer hyper-parameters and clipping come from ``workload`` so the
adapters differ only in how the engine is driven.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from trainbench.workload import GRAD_CLIP, Workload, ds_config, torch_optimizer


class EngineUnavailable(RuntimeError):
    """The engine's library is missing or not built yet (reported, not a failure)."""


@dataclass
class EngineRow:
    """Which engine and which ZeRO-equivalent stage a child process runs."""

    engine: str  # "ddp" | "fsdp2" | "deepspeed" | "shardspeed"
    stage: int


# Engine name of the rows that run shardspeed from ``train_bench.py --baseline-root``.
BASELINE = "shardspeed@base"

# Stage each torch engine stands in for (DDP replicates; FSDP2's reshard knob picks 2 vs 3).
TORCH_STAGE_ENGINES: dict[int, tuple[str, str]] = {
    0: ("ddp", "DDP"),
    2: ("fsdp2", "FSDP2 reshard=False"),
    3: ("fsdp2", "FSDP2 reshard=True"),
}


def row_label(engine: str, stage: int) -> str:
    """Human-readable name of a row, e.g. ``DeepSpeed Z2`` or ``FSDP2 reshard=True``."""
    if engine in ("ddp", "fsdp2"):
        return TORCH_STAGE_ENGINES[stage][1]
    names = {"deepspeed": "DeepSpeed", "shardspeed": "shardspeed", BASELINE: BASELINE}
    return names[engine] + f" Z{stage}"


def _autocast(workload: Workload, device: torch.device) -> contextlib.AbstractContextManager:
    if workload.dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class Runner:
    """One engine ready to train: ``train_step(x, y)`` does forward, backward and step."""

    def __init__(self, step_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], info: dict):
        self._step_fn = step_fn
        self.info = info  # engine facts worth reporting (optimizer class, versions, ...)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._step_fn(x, y)


def build_ddp(model: nn.Module, workload: Workload, device: torch.device) -> Runner:
    """Stage-0 peer: DistributedDataParallel, fp32 params, autocast for bf16."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = model.to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch_optimizer(ddp.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with _autocast(workload, device):
            _, loss = ddp(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return Runner(step, {"optimizer": type(opt).__name__})


def build_fsdp2(
    model: nn.Module, workload: Workload, device: torch.device, reshard: bool
) -> Runner:
    """Stage-2 (``reshard=False``) or stage-3 (``reshard=True``) peer: FSDP2 ``fully_shard``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy()
    if workload.dtype == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = model.to(device)
    for block in model.h:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    opt = torch_optimizer(model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return Runner(step, {"optimizer": type(opt).__name__})


LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def gpt_loss(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss of ``shardspeed.models.GPT``: ``module(x, y)`` returns ``(logits, loss)``."""
    return module(x, y)[1]


def ds_api_runner(
    initialize: Callable[..., Any], model: nn.Module, config: dict, loss_fn: LossFn = gpt_loss
) -> Runner:
    """Drive an engine with DeepSpeed's API: ``loss_fn(engine, x, y)``, ``backward``, ``step``."""
    engine, optimizer, _, _ = initialize(model=model, config=config)
    device = getattr(engine, "device", None)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if device is not None:
            x, y = x.to(device), y.to(device)
        loss = loss_fn(engine, x, y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    inner = getattr(optimizer, "optimizer", optimizer)
    module = getattr(engine, "module", model)
    info = {
        "optimizer": type(optimizer).__name__,
        "inner_optimizer": type(inner).__name__,
        # elements this rank's module holds (a tensor-parallel shard; 0-size under ZeRO 3)
        "module_numel": sum(p.numel() for p in module.parameters()),
    }
    return Runner(step, info)


def import_deepspeed() -> Any:
    """The ``deepspeed`` module, or EngineUnavailable outside ``.venv-peers``."""
    try:
        import deepspeed
    except ImportError as exc:
        raise EngineUnavailable(
            f"deepspeed is not importable ({exc}); run `make bench-peers` and use "
            ".venv-peers/bin/python"
        ) from exc
    return deepspeed


def build_deepspeed(model: nn.Module, workload: Workload, stage: int) -> Runner:
    """DeepSpeed ZeRO ``stage`` from the shared ds_config."""
    deepspeed = import_deepspeed()
    runner = ds_api_runner(deepspeed.initialize, model, ds_config(workload, stage))
    runner.info["deepspeed"] = deepspeed.__version__
    return runner


def shardspeed_initialize() -> Callable[..., Any]:
    """``shardspeed.initialize``, or EngineUnavailable while the engine is not built yet."""
    try:
        import shardspeed

        return shardspeed.initialize
    except (ImportError, AttributeError) as exc:
        raise EngineUnavailable(f"shardspeed.initialize: {type(exc).__name__}: {exc}") from exc


def build_shardspeed(model: nn.Module, workload: Workload, stage: int) -> Runner:
    """shardspeed ZeRO ``stage`` from the same ds_config DeepSpeed gets."""
    initialize = shardspeed_initialize()
    config = ds_config(workload, stage)
    if workload.compile:  # DeepSpeed 0.19.8 has no such keys: shardspeed rows only
        config["compile"] = {"enabled": True, "backend": workload.compile}
    return ds_api_runner(initialize, model, config)


def build_runner(
    row: EngineRow, model: nn.Module, workload: Workload, device: torch.device
) -> Runner:
    """Dispatch to the adapter of ``row``."""
    if row.engine == "ddp":
        return build_ddp(model, workload, device)
    if row.engine == "fsdp2":
        return build_fsdp2(model, workload, device, reshard=row.stage == 3)
    if row.engine == "deepspeed":
        return build_deepspeed(model, workload, row.stage)
    if row.engine == "shardspeed":
        return build_shardspeed(model, workload, row.stage)
    raise ValueError(
        f"engine={row.engine!r} is not known; use one of ddp, fsdp2, deepspeed, shardspeed"
    )


def preload_engine_library(engine: str) -> None:
    """Import the engine's library before the memory baseline is taken (best effort)."""
    with contextlib.suppress(Exception):
        if engine == "deepspeed":
            import deepspeed  # noqa: F401
        elif engine == "shardspeed":
            shardspeed_initialize()
        elif engine == "fsdp2":
            import torch.distributed.fsdp  # noqa: F401

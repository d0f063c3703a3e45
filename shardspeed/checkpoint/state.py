"""Engine state that is not a tensor fragment: counters, scaler, scheduler, RNG, dataloader."""

from __future__ import annotations

import json
import random
from typing import Any

import torch

from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)


def _json_value(value: Any) -> Any:
    """Hyperparameters as JSON: tuples become lists, tensors become numbers."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (tuple, list)):
        return [_json_value(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return None  # unknown objects (e.g. callables) are not restored


def capture_rng_state() -> dict[str, Any]:
    """Torch CPU/CUDA, Python and numpy RNG states as JSON-able lists."""
    state: dict[str, Any] = {
        "torch_cpu": torch.get_rng_state().tolist(),
        "python": _json_value(list(random.getstate())),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np

        name, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)]
    except ImportError:
        pass
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch_cpu"], dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        for device, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(torch.tensor(s, dtype=torch.uint8), device)
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            return
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def param_group_hparams(optimizer: torch.optim.Optimizer | None) -> list[dict[str, Any]]:
    if optimizer is None:
        return []
    return [
        {k: _json_value(v) for k, v in g.items() if k != "params" and _json_value(v) is not None}
        for g in optimizer.param_groups
    ]


def restore_param_group_hparams(
    optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]]
) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(
            f"checkpoint has {len(saved)} optimizer param group(s) but the engine has "
            f"{len(optimizer.param_groups)}; build the optimizer with the same groups or load "
            "with load_optimizer_states=False."
        )
    for group, hp in zip(optimizer.param_groups, saved):
        for k, v in hp.items():
            if k in group:
                group[k] = tuple(v) if isinstance(group[k], tuple) else v


def capture_engine_state(engine: Any) -> dict[str, Any]:
    """Counters, loss scaler, LR scheduler, dataloader position, config, topology."""
    sched = engine.lr_scheduler
    loader = engine.training_dataloader
    return {
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps,
        "gradient_accumulation_steps": _gas(engine),
        "skipped_steps": engine.skipped_steps,
        "loss_scaler": _json_value_dict(engine.loss_scaler.state_dict()),
        "lr_scheduler": _json_value_dict(sched.state_dict()) if sched is not None else None,
        "dataloader": dict(loader.state_dict()) if hasattr(loader, "state_dict") else None,
        "param_groups": param_group_hparams(engine.basic_optimizer),
        "config": json.loads(json.dumps(engine.config, default=str)),
        "stage": engine.stage,
        "dp_world_size": engine.dp_world_size,
    }


def _gas(engine: Any) -> int:
    return int(engine._config.gradient_accumulation_steps)


def _micro_steps(engine: Any, state: dict[str, Any]) -> int:
    """Micro-steps in the loading engine's accumulation (GAS may differ from the saved one)."""
    micro, saved_gas = int(state["micro_steps"]), int(state["gradient_accumulation_steps"])
    if saved_gas == _gas(engine):
        return micro
    if micro % saved_gas:
        logger.warning(
            f"checkpoint was saved {micro % saved_gas} micro-step(s) into an accumulation window "
            f"of {saved_gas}; with gradient_accumulation_steps={_gas(engine)} the next micro-step "
            "starts a new window"
        )
    return int(state["global_steps"]) * _gas(engine)


def _json_value_dict(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _json_value(v) for k, v in d.items()}


def restore_engine_state(
    engine: Any, state: dict[str, Any], *, optimizer_states: bool, scheduler_states: bool
) -> None:
    engine.global_steps = int(state["global_steps"])
    engine.global_samples = int(state["global_samples"])
    engine.micro_steps = _micro_steps(engine, state)
    engine.skipped_steps = int(state["skipped_steps"])
    if optimizer_states:
        engine.loss_scaler.load_state_dict(state["loss_scaler"])
        if engine.basic_optimizer is not None and state["param_groups"]:
            restore_param_group_hparams(engine.basic_optimizer, state["param_groups"])
    if scheduler_states and engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    loader = engine.training_dataloader
    if state.get("dataloader") is not None and hasattr(loader, "load_state_dict"):
        loader.load_state_dict(state["dataloader"])

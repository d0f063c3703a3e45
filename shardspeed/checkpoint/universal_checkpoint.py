"""DeepSpeed universal checkpoints: read one into a ShardSpeed checkpoint.

``ds_to_universal`` (DeepSpeed's, or :mod:`shardspeed.checkpoint.ds_to_universal`) turns a
ZeRO tag into a folder that holds every parameter whole, one folder per name::

    <tag>/zero/<param name>/fp32.pt        # stages 1/2: {"param": full tensor, "cat_dim": 0}
    <tag>/zero/<param name>/exp_avg.pt     # stage 3: the flat tensor itself
    <tag>/zero/<param name>/exp_avg_sq.pt
    <tag>/zero/<param name>/step.pt        # stages 1/2: Adam's step
    <tag>/zero/optimizer_state.pt          # loss scaler, param_groups (+ stage 3's step)
    <tag>/mp_rank_00_model_states.pt       # counters, scheduler, module (stage 3: per rank)
    <parent>/latest_universal              # the tag

:func:`import_universal_checkpoint` rebuilds each trainable parameter's master and
per-element optimizer state from it and writes a world-size-1 stage-0 ShardSpeed checkpoint,
which ``load_checkpoint`` reshards onto any world size and stage. With DeepSpeed's config
``"checkpoint": {"load_universal": true}``, ``engine.load_checkpoint(dir)`` does this on the
fly (:mod:`shardspeed.checkpoint.foreign_load`). Files are unpickled through the allow-list
unpickler of :mod:`shardspeed.checkpoint.deepspeed_import`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from shardspeed.checkpoint.deepspeed_import import (
    MODEL_STATES,
    MODEL_STATES_Z3,
    _group_scalars,
    _load_trusted,
    write_imported,
)
from shardspeed.checkpoint.format import KIND_BUFFER, KIND_MASTER, KIND_PARAM
from shardspeed.checkpoint.integrity import inside, read_tag_file
from shardspeed.checkpoint.shards import FragmentWriter

LATEST_UNIVERSAL = "latest_universal"
OPTIMIZER_STATE = "optimizer_state.pt"
STATE_FILES = {"fp32": KIND_MASTER}  # other <kind>.pt files keep their name (exp_avg, ...)


def resolve_universal_tag(load_dir: Path, tag: str | None) -> str:
    """``tag``, else the one named by ``latest_universal`` (else ``latest``) in ``load_dir``."""
    if tag is None:
        for name in (LATEST_UNIVERSAL, "latest"):
            if (load_dir / name).is_file():
                tag = read_tag_file(load_dir / name)
                break
    if tag is None or not (inside(load_dir, tag, "universal tag") / "zero").is_dir():
        raise ValueError(
            f"checkpoint.load_universal is true but {str(load_dir)!r} has no universal "
            f"checkpoint (tag {tag!r}: no '<tag>/zero/' folder; {LATEST_UNIVERSAL!r} names the "
            "tag). Fix: convert a ZeRO checkpoint with ds_to_universal --input_folder "
            "DIR/TAG --output_folder DIR_UNIVERSAL/TAG, or set load_universal to false."
        )
    return tag


def _model_states(tag_dir: Path) -> dict[str, Any]:
    for name in (MODEL_STATES, MODEL_STATES_Z3):
        if (tag_dir / name).is_file():
            return _load_trusted(inside(tag_dir, name, "model states file"))
    raise ValueError(
        f"universal checkpoint {str(tag_dir)!r} has neither {MODEL_STATES} nor "
        f"{MODEL_STATES_Z3}; ds_to_universal copies it there. Copy it from the source tag."
    )


def _read_state(path: Path, numel: int, what: str) -> torch.Tensor:
    value = _load_trusted(path)
    tensor = value["param"] if isinstance(value, dict) else value
    if not isinstance(tensor, torch.Tensor) or tensor.numel() != numel:
        got = tensor.numel() if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(
            f"{str(path)!r}: {what} should hold {numel} elements, got {got}; the universal "
            "checkpoint does not match its model states file. Convert it again."
        )
    return tensor.detach().reshape(-1).float()


def _step_record(zero_dir: Path, names: list[str], optim: dict[str, Any]) -> dict[str, Any]:
    """Adam's ``step`` of a group: ``<first param>/step.pt`` (stages 1/2) or the optimizer
    state of stage 3's ``optimizer_state.pt``."""
    for name in names:
        path = zero_dir / name / "step.pt"
        if path.is_file():
            return _group_scalars({"step": _load_trusted(path)}, torch.zeros(0))
    inner = optim.get("optimizer_state_dict") or {}
    state = (inner.get("state") or {}).get(0, {})
    return _group_scalars({k: v for k, v in state.items() if k == "step"}, torch.zeros(0))


def import_universal_checkpoint(
    tag_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], out_tag: str
) -> Path:
    """Convert universal checkpoint folder ``tag_dir`` into ShardSpeed checkpoint
    ``<out_dir>/<out_tag>/`` (world size 1, stage 0; loads at any layout)."""
    tag_dir, out_dir = Path(tag_dir), Path(out_dir)
    zero_dir = tag_dir / "zero"
    model = _model_states(tag_dir)
    optim = _load_trusted(inside(zero_dir, OPTIMIZER_STATE, "universal optimizer state"))
    groups = list(optim.get("param_groups") or [])
    writer = FragmentWriter()
    scalars = []
    for name_shapes in model["param_shapes"]:
        names = list(name_shapes)
        for name in names:
            shape = torch.Size(name_shapes[name])
            param_dir = inside(zero_dir, name, "universal parameter folder")
            for path in sorted(param_dir.glob("*.pt")):
                if path.stem == "step":
                    continue
                kind = STATE_FILES.get(path.stem, path.stem)
                tensor = _read_state(path, shape.numel(), f"{name} {path.stem}")
                writer.add(name, kind, list(shape), 0, tensor)
        scalars.append(_step_record(zero_dir, names, optim))
    module = model["module"]
    for name, shape in (model.get("frozen_param_shapes") or {}).items():
        if module[name].numel() == torch.Size(shape).numel():
            writer.add(name, KIND_PARAM, list(shape), 0, module[name])
    for name in model.get("buffer_names") or []:
        if name in module:
            writer.add(name, KIND_BUFFER, list(module[name].shape), 0, module[name])
    return write_imported(
        out_dir,
        out_tag,
        model,
        writer,
        scalars,
        groups,
        loss_scaler=optim.get("loss_scaler"),
        param_order=list(module.keys()),
    )

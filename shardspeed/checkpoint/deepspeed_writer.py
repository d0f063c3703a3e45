"""Write DeepSpeed 0.19's ZeRO-1/2/3 files into a tag, next to ShardSpeed's own files.

With ``"checkpoint": {"layout": "deepspeed"}`` rank 0 runs :func:`write_deepspeed_files`
while committing a save: after every rank wrote its safetensors file and the manifest
exists, before the tag directory is renamed into place (so the DeepSpeed files appear
atomically with the tag). It reads the full fp32 masters and optimizer state from the
native files (:class:`~shardspeed.checkpoint.shards.SliceReader`) and lays them out as
DeepSpeed's ZeRO optimizer would on ``dp`` ranks (:mod:`shardspeed.checkpoint.deepspeed_layout`).

The files hold what DeepSpeed's ``load_checkpoint``, its ``zero_to_fp32.py``, its
``ds_to_universal`` and PyTorch Lightning read; see ``docs/checkpoints.md``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardspeed.checkpoint.deepspeed_layout import (
    DS_VERSION,
    model_states_name,
    optim_states_name,
    stage3_chunk,
    stage3_sub_groups,
    zero12_partitions,
)
from shardspeed.checkpoint.deepspeed_pickle import StaticLossScaler, save_pt
from shardspeed.checkpoint.format import (
    KIND_BUFFER,
    KIND_MASTER,
    KIND_PARAM,
    dtype_from_name,
    join_client_state,
)
from shardspeed.checkpoint.shards import SliceReader

DEFAULT_SUB_GROUP_SIZE = 1_000_000_000


@dataclass(frozen=True)
class DeepSpeedLayoutSpec:
    """What DeepSpeed's files need beyond the native ones, captured from the engine at save.

    ``param_groups``: trainable parameter names per optimizer param group, in module order
    (the order DeepSpeed flattens ``model.parameters()`` in).
    """

    param_groups: list[list[str]]
    bf16: bool
    stage: int
    dp_world_size: int
    sub_group_size: int = DEFAULT_SUB_GROUP_SIZE
    gradient_clipping: float = 0.0


def _tuple_hparams(group: dict[str, Any], index: list[int]) -> dict[str, Any]:
    out = {k: tuple(v) if isinstance(v, list) else v for k, v in group.items()}
    out["params"] = index
    return out


def _scalar_state(scalars: dict[str, Any]) -> dict[str, Any]:
    """Per-group scalar optimizer state (Adam's ``step``) as the optimizer holds it."""
    out: dict[str, Any] = {}
    for key, record in scalars.items():
        value = record.get("value")
        if "dtype" in record:
            out[key] = torch.tensor(value, dtype=dtype_from_name(record["dtype"]))
        else:
            out[key] = value
    return out


class _Source:
    """Full fp32 tensors of the native tag, one parameter and kind at a time."""

    def __init__(self, tag_dir: Path, manifest: dict[str, Any]) -> None:
        self.reader = SliceReader(tag_dir)
        self.index = manifest["index"]

    def full(self, name: str, kind: str) -> torch.Tensor:
        entry = self.index[name]
        return self.reader.full(entry, kind, name).reshape(-1).float()

    def state_kinds(self, name: str) -> list[str]:
        kinds = self.index[name]["kinds"]
        return [k for k in kinds if k not in (KIND_MASTER, KIND_PARAM, KIND_BUFFER)]


def _module_state(
    source: _Source, manifest: dict[str, Any], dtype: torch.dtype, stage: int
) -> tuple[OrderedDict[str, torch.Tensor], list[str], dict[str, torch.Size]]:
    """The module state dict in the training dtype (stage 3: empty parameters, as DeepSpeed's
    partitioned module returns them), its buffer names and the frozen parameters' shapes."""
    aliases = manifest.get("tied_aliases", {})
    module: OrderedDict[str, torch.Tensor] = OrderedDict()
    buffers: list[str] = []
    frozen: dict[str, torch.Size] = {}
    for key in manifest["param_order"]:
        name = aliases.get(key, key)
        entry = source.index.get(name)
        if entry is None:
            continue
        shape = torch.Size(entry["shape"])
        kinds = entry["kinds"]
        if KIND_BUFFER in kinds:
            module[key] = source.reader.full(entry, KIND_BUFFER, name).reshape(shape)
            buffers.append(key)
            continue
        kind = KIND_MASTER if KIND_MASTER in kinds else KIND_PARAM
        if kind == KIND_PARAM and name == key:
            frozen[key] = shape
        if stage == 3:
            module[key] = torch.empty(0, dtype=dtype)
        else:
            module[key] = source.full(name, kind).to(dtype).reshape(shape)
    return module, buffers, frozen


def _zero12_rank_files(
    source: _Source, spec: DeepSpeedLayoutSpec, hparams: list[dict[str, Any]], scalars: list[Any]
) -> list[dict[str, Any]]:
    """Every rank's stage-1/2 ``optimizer_state_dict``."""
    dp = spec.dp_world_size
    ranks: list[dict[str, Any]] = [{"state": {}, "lean": [], "paddings": []} for _ in range(dp)]
    for g, names in enumerate(spec.param_groups):
        kinds = [KIND_MASTER, *(source.state_kinds(names[0]) if names else [])]
        flats = {k: torch.cat([source.full(n, k) for n in names]) for k in kinds}
        parts = zero12_partitions(flats[KIND_MASTER].numel(), dp)
        for part in parts:
            sliced = {}
            for kind, flat in flats.items():
                padded = torch.zeros(part.size)
                held = flat[part.start : part.start + part.size]
                padded[: held.numel()] = held
                sliced[kind] = padded
            rank = ranks[part.rank]
            rank["lean"].append(sliced[KIND_MASTER][: part.size - part.padding].clone())
            rank["paddings"].append(part.padding)
            state = _scalar_state(scalars[g] if g < len(scalars) else {})
            state.update({k: v for k, v in sliced.items() if k != KIND_MASTER})
            rank["state"][g] = state
    out = []
    for rank in ranks:
        out.append(
            {
                "loss_scaler": StaticLossScaler(1.0),
                "dynamic_loss_scale": False,
                "overflow": False,
                "clip_grad": float(spec.gradient_clipping),
                "base_optimizer_state": {
                    "state": rank["state"],
                    "param_groups": [_tuple_hparams(h, [g]) for g, h in enumerate(hparams)],
                },
                "single_partition_of_fp32_groups": rank["lean"],
                "zero_stage": spec.stage,
                "group_paddings": rank["paddings"],
                "param_alignment_paddings": [[0] * len(n) for n in spec.param_groups],
                "partition_count": [dp] * len(spec.param_groups),
                "ds_version": DS_VERSION,
            }
        )
    return out


def _zero3_rank_files(
    source: _Source,
    spec: DeepSpeedLayoutSpec,
    hparams: list[dict[str, Any]],
    scalars: list[Any],
    shapes: dict[str, torch.Size],
) -> tuple[list[dict[str, Any]], list[OrderedDict[str, torch.Size]]]:
    """Every rank's stage-3 ``optimizer_state_dict`` and the per-sub-group param shapes."""
    dp = spec.dp_world_size
    flats: list[list[torch.Tensor]] = [[] for _ in range(dp)]
    states: list[dict[int, dict[str, Any]]] = [{} for _ in range(dp)]
    group_subs: list[list[int]] = []
    sub_shapes: list[OrderedDict[str, torch.Size]] = []
    for g, names in enumerate(spec.param_groups):
        numels = [shapes[n].numel() for n in names]
        group_subs.append([])
        for members in stage3_sub_groups(numels, dp, spec.sub_group_size):
            sub = len(sub_shapes)
            group_subs[g].append(sub)
            sub_names = [names[i] for i in members]
            sub_shapes.append(OrderedDict((n, shapes[n]) for n in sub_names))
            kinds = [KIND_MASTER, *(source.state_kinds(sub_names[0]) if sub_names else [])]
            per_rank: list[dict[str, list[torch.Tensor]]] = [
                {k: [] for k in kinds} for _ in range(dp)
            ]
            for name in sub_names:
                chunk = stage3_chunk(shapes[name].numel(), dp)
                for kind in kinds:
                    full = source.full(name, kind)
                    padded = torch.zeros(chunk * dp)
                    padded[: full.numel()] = full
                    for r, piece in enumerate(padded.view(dp, chunk)):
                        per_rank[r][kind].append(piece.clone())
            for r in range(dp):
                cat = {k: torch.cat(v) if v else torch.zeros(0) for k, v in per_rank[r].items()}
                flats[r].append(cat[KIND_MASTER])
                state = _scalar_state(scalars[g] if g < len(scalars) else {})
                state.update({k: v for k, v in cat.items() if k != KIND_MASTER})
                states[r][sub] = state
    out = []
    for r in range(dp):
        out.append(
            {
                "zero_stage": 3,
                "loss_scaler": StaticLossScaler(1.0),
                "dynamic_loss_scale": False,
                "overflow": False,
                "partition_count": dp,
                "optimizer_state_dict": {
                    "state": states[r],
                    "param_groups": [
                        _tuple_hparams(h, group_subs[g]) for g, h in enumerate(hparams)
                    ],
                },
                "fp32_flat_groups": flats[r],
            }
        )
    return out, sub_shapes


def write_deepspeed_files(
    tag_dir: Path, manifest: dict[str, Any], rank0_meta: dict[str, Any], spec: DeepSpeedLayoutSpec
) -> list[str]:
    """Write DeepSpeed's model and optimizer files for the native tag in ``tag_dir``.

    ``manifest`` is the tag's manifest, ``rank0_meta`` rank 0's JSON (engine counters,
    scheduler, config, client state). Returns the names of the files written.
    """
    source = _Source(tag_dir, manifest)
    engine = rank0_meta["engine"]
    config = engine.get("config") or {}
    dtype = torch.bfloat16 if spec.bf16 else torch.float32
    hparams = [dict(g) for g in engine.get("param_groups") or [{} for _ in spec.param_groups]]
    scalars = manifest.get("optimizer_scalars") or []
    shapes = {n: torch.Size(source.index[n]["shape"]) for g in spec.param_groups for n in g}
    module, buffers, frozen = _module_state(source, manifest, dtype, spec.stage)
    client_tensors = {
        k: source.reader.read(rank0_meta["file"], k, 0, None) for k in rank0_meta["client_tensors"]
    }
    client = join_client_state(rank0_meta["client_state"], client_tensors)
    if spec.stage == 3:
        optim, param_shapes = _zero3_rank_files(source, spec, hparams, scalars, shapes)
    else:
        optim = _zero12_rank_files(source, spec, hparams, scalars)
        param_shapes = [OrderedDict((n, shapes[n]) for n in g) for g in spec.param_groups]
    stage2_frozen = spec.stage == 2
    model_states: dict[str, Any] = {
        "module": module,
        "buffer_names": buffers,
        "optimizer": None,
        "param_shapes": param_shapes,
        "frozen_param_shapes": frozen if stage2_frozen or spec.stage == 3 else None,
        "shared_params": dict(manifest.get("tied_aliases", {})),
        "frozen_param_fragments": (
            {n: module[n].clone() for n in frozen}
            if stage2_frozen
            else ({} if spec.stage == 3 else None)
        ),
        "lr_scheduler": engine.get("lr_scheduler"),
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": int(engine.get("skipped_steps", 0)),
        "global_steps": int(engine.get("global_steps", 0)),
        "global_samples": int(engine.get("global_samples", 0)),
        "dp_world_size": spec.dp_world_size,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": config,
        "ds_version": DS_VERSION,
        **(client if isinstance(client, dict) else {}),
    }
    written = []
    model_ranks = range(spec.dp_world_size) if spec.stage == 3 else range(1)
    for r in model_ranks:
        name = model_states_name(spec.stage, r)
        save_pt(model_states, tag_dir / name)
        written.append(name)
    for r, state in enumerate(optim):
        name = optim_states_name(r, spec.bf16)
        save_pt(
            {"optimizer_state_dict": state, "ds_config": config, "ds_version": DS_VERSION},
            tag_dir / name,
        )
        written.append(name)
    return written


LAYOUTS = ("auto", "native", "deepspeed")


def _refuse(what: str, value: Any, fix: str) -> ValueError:
    return ValueError(
        f'checkpoint.layout="deepspeed" does not support {what} (got {value}); it writes '
        f"DeepSpeed's ZeRO 1/2/3 data-parallel layout for fp32 and bf16 only. Fix: {fix}."
    )


def layout_spec(engine: Any) -> DeepSpeedLayoutSpec:
    """The engine's :class:`DeepSpeedLayoutSpec`; ``ValueError`` for a layout DeepSpeed's
    plain ZeRO files cannot hold (stage 0, fp16, pipeline/tensor/sequence/expert parallelism)."""
    from shardspeed.checkpoint.commit import mesh_shape
    from shardspeed.checkpoint.expert_placement import ExpertNames
    from shardspeed.checkpoint.shards import param_names

    native = 'save with "checkpoint": {"layout": "native"}, which holds it'
    stage = int(engine.stage)
    if stage not in (1, 2, 3):
        raise _refuse(
            "ZeRO stage 0", f"zero_optimization.stage={stage}", f"use stage 1-3, or {native}"
        )
    if engine.fp16_enabled():
        raise _refuse("fp16 (a dynamic loss scale)", "fp16.enabled=true", f"use bf16, or {native}")
    mesh = mesh_shape(engine) or {}
    others = {axis: size for axis, size in mesh.items() if axis != "data" and size > 1}
    if others:
        raise _refuse("model parallelism", f"mesh {mesh}", native)
    experts = ExpertNames.of(engine.module)
    if any(experts.is_expert(n) for n, _ in engine.module.named_parameters()):
        raise _refuse("MoE expert layers", "expert parameters in the model", native)
    order = {name: i for i, name in enumerate(n for n, _ in engine.module.named_parameters())}
    names = param_names(engine.module)
    groups = [
        sorted((names[id(p)] for p in g.params), key=order.__getitem__) for g in engine.flat_groups
    ]
    zero = engine._config.zero_optimization
    return DeepSpeedLayoutSpec(
        param_groups=groups,
        bf16=bool(engine.bfloat16_enabled()),
        stage=stage,
        dp_world_size=int(engine.dp_world_size),
        sub_group_size=int(getattr(zero, "sub_group_size", DEFAULT_SUB_GROUP_SIZE)),
        gradient_clipping=float(getattr(engine._config, "gradient_clipping", 0.0) or 0.0),
    )

"""Import a DeepSpeed ZeRO-1/2/3 checkpoint folder as a ShardSpeed engine checkpoint.

DeepSpeed (0.19.x) writes, per tag, ``mp_rank_00_model_states.pt`` (module state dict,
``param_shapes``, ``shared_params``, counters, LR scheduler, ``ds_config``) and one
``zero_pp_rank_{dp}_mp_rank_00_optim_states.pt`` per data-parallel rank holding that rank's
slice of every param group's flat fp32 partition (``single_partition_of_fp32_groups``) and
the base optimizer's state for it (``base_optimizer_state``). The full flat group is the
ranks' partitions concatenated; parameters lie in it back to back in ``param_shapes`` order,
followed by the alignment padding of the last rank. At stage 3 every DP rank writes
``zero_pp_rank_{dp}_mp_rank_00_model_states.pt`` (rank 0's is read) and its optimizer file
holds ``fp32_flat_groups`` (each parameter split on its own into ``ceil(numel / world)``
chunks, the last one padded) and the base optimizer's ``optimizer_state_dict``.

Expert-parallel MoE checkpoints (per-expert ``layer_*_expert_*`` files, expert groups
partitioned over ``expert_data``) are read through
:mod:`shardspeed.checkpoint.deepspeed_experts`; experts get their global ids.

The import rebuilds every trainable parameter's full fp32 master and per-element optimizer
state (``exp_avg``, ``exp_avg_sq``, ...) and writes them as if saved by a world-size-1
stage-0 ShardSpeed engine; :func:`shardspeed.checkpoint.load_checkpoint` then reshards it
onto any world size and stage.

DeepSpeed's ``.pt`` files are pickles holding non-tensor objects, so this module (and only
this module: the normal load path never unpickles) unpickles them, through an unpickler
that resolves only an allow-list of globals: torch's tensor rebuild functions, dtypes and
``Size``, builtin containers, ``OrderedDict``, ``argparse.Namespace`` and DeepSpeed's own
data classes by qualified name (as inert stand-ins; DeepSpeed is never imported). Any
other global (``os.system``, ``builtins.eval``, ...) is refused with its name.
"""

from __future__ import annotations

import _compat_pickle
import os
import pickle
import re
import shutil
import types
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardspeed.checkpoint.commit import read_rank_metas
from shardspeed.checkpoint.deepspeed_experts import (
    ep_rank_sources,
    expert_files,
    expert_suffix,
    globalise,
    group_ep_size,
    with_expert_keys,
)
from shardspeed.checkpoint.format import (
    FORMAT_VERSION,
    KIND_BUFFER,
    KIND_MASTER,
    KIND_PARAM,
    LATEST,
    MANIFEST,
    TMP_MARKER,
    build_index,
    dtype_name,
    rank_stem,
    split_client_state,
    write_json,
)
from shardspeed.checkpoint.integrity import (
    CHECKSUMS,
    RANK_FILE_SHA,
    inside,
    read_tag_file,
    seal,
)
from shardspeed.checkpoint.safetensors_io import write_safetensors
from shardspeed.checkpoint.shards import FragmentWriter
from shardspeed.checkpoint.state import capture_rng_state
from shardspeed.utils.io import atomic_write_text
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

MODEL_STATES = "mp_rank_00_model_states.pt"
MODEL_STATES_Z3 = "zero_pp_rank_0_mp_rank_00_model_states.pt"  # stage 3: one per DP rank
# DeepSpeed prefixes bf16_ to the ZeRO files of a bf16 run
_OPTIM_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
# top-level keys of DeepSpeed's model states; anything else is the user's client_state
_DS_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "frozen_param_fragments",
        "shared_params",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "checkpoint_parallel_dimensions",
        "ds_config",
        "ds_version",
    }
)


class _DeepSpeedObject:
    """Stand-in for a DeepSpeed class: plain data (constructor args and attributes), no code."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)

    def __int__(self) -> int:  # ZeroStageEnum
        return int(self.args[0])


# The globals a DeepSpeed 0.19 checkpoint pickles (torch.save, protocol 2), by qualified
# name. Storages never reach find_class: torch.load resolves them by name itself.
_TORCH_REBUILDERS = frozenset(
    f"torch._utils.{name}"
    for name in (
        "_rebuild_tensor",
        "_rebuild_tensor_v2",
        "_rebuild_tensor_v3",
        "_rebuild_parameter",
        "_rebuild_parameter_with_state",
        "_rebuild_sparse_tensor",
        "_rebuild_meta_tensor_no_storage",
        "_rebuild_nested_tensor",
        "_rebuild_device_tensor_from_cpu_tensor",
    )
) | {"torch._tensor._rebuild_from_type", "torch._tensor._rebuild_from_type_v2"}
_PLAIN_TYPES = frozenset(
    {
        "torch.Tensor",
        "torch.Size",
        "torch.device",
        "torch.nn.parameter.Parameter",
        "collections.OrderedDict",
        "argparse.Namespace",
        "_codecs.encode",  # how protocol 2 stores bytes
        *(f"builtins.{n}" for n in ("set", "frozenset", "list", "dict", "tuple", "slice")),
        *(f"builtins.{n}" for n in ("int", "float", "complex", "bool", "str", "bytes")),
        "builtins.bytearray",
        "numpy.dtype",
        "numpy.core.multiarray.scalar",
        "numpy._core.multiarray.scalar",
    }
)
DEEPSPEED_DATA_CLASSES = frozenset(
    {
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum",
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
)
"""DeepSpeed classes a checkpoint may hold; each becomes a plain-data stand-in (DeepSpeed's
code is never imported or run)."""


def _torch_constant(module: str, name: str) -> bool:
    """``torch.float32``, ``torch.strided``, ``torch.contiguous_format``, ``torch.per_tensor_affine``."""
    value = getattr(torch, name, None) if module == "torch" else None
    kinds = (torch.dtype, torch.layout, torch.memory_format, torch.qscheme)
    return isinstance(value, kinds)


class RefusedGlobalError(pickle.UnpicklingError):
    """A pickle names a global outside the allow-list of what DeepSpeed checkpoints hold."""


class _InertModule:
    """What ``pydoc.locate(path)`` gives inside ShardSpeed's unpickler: a name, no import."""

    def __init__(self, path: str) -> None:
        self.path = path


def _stand_in(qualified: str) -> type:
    found = _STAND_INS.get(qualified)
    if found is None:
        module, name = qualified.rsplit(".", 1)
        found = type(name, (_DeepSpeedObject,), {"__module__": module})
        _STAND_INS[qualified] = found
    return found


_STAND_INS: dict[str, type] = {}


def _inert_getattr(obj: Any, name: str, default: Any = None) -> Any:
    """``getattr`` as ShardSpeed's loss-scaler recipe uses it
    (:mod:`shardspeed.checkpoint.deepspeed_pickle`): only on an :class:`_InertModule`, only
    for a DeepSpeed data class (a stand-in) or the recipe's ``float`` fallback."""
    if isinstance(obj, _InertModule):
        qualified = f"{obj.path}.{name}"
        if qualified in DEEPSPEED_DATA_CLASSES:
            return _stand_in(qualified)
    if default is float:
        return float
    raise RefusedGlobalError(
        f"the pickle calls getattr({type(obj).__name__}, {name!r}) outside ShardSpeed's "
        "loss-scaler recipe"
    )


def _inert_locate(path: str) -> Any:
    """``pydoc.locate`` inside ShardSpeed's unpickler: the two paths of the loss-scaler recipe
    as inert stand-ins, nothing imported; any other path is refused."""
    if path == "builtins.getattr":
        return _inert_getattr
    if f"{path}.LossScaler" in DEEPSPEED_DATA_CLASSES:
        return _InertModule(path)
    raise RefusedGlobalError(f"the pickle locates {path!r} outside ShardSpeed's loss-scaler recipe")


class _Unpickler(pickle.Unpickler):
    """Resolves only the globals of :data:`_TORCH_REBUILDERS`, :data:`_PLAIN_TYPES`, torch
    dtypes/layouts and :data:`DEEPSPEED_DATA_CLASSES` (as stand-ins); ``pydoc.locate`` as an
    inert stand-in (ShardSpeed's loss-scaler recipe, see
    :mod:`shardspeed.checkpoint.deepspeed_pickle`); refuses the rest."""

    def find_class(self, module: str, name: str) -> Any:
        module, name = _python3_name(module, name)
        qualified = f"{module}.{name}"
        if qualified in DEEPSPEED_DATA_CLASSES:
            return _stand_in(qualified)
        if qualified == "pydoc.locate":
            return _inert_locate
        if qualified in _TORCH_REBUILDERS or qualified in _PLAIN_TYPES:
            return super().find_class(module, name)
        if _torch_constant(module, name):
            return getattr(torch, name)
        raise RefusedGlobalError(
            f"the pickle names {qualified!r}, which is not a type DeepSpeed checkpoints hold "
            "(tensors, storages, builtin containers, OrderedDict, argparse.Namespace, "
            f"DeepSpeed's {sorted(c.rsplit('.', 1)[1] for c in DEEPSPEED_DATA_CLASSES)}); "
            "refusing to unpickle it, as it could run code"
        )


def _python3_name(module: str, name: str) -> tuple[str, str]:
    """Protocol-2 pickles use Python 2 names (``__builtin__.set``): map them as pickle does."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def _restricted_load(file: Any, **kwargs: Any) -> Any:
    return _Unpickler(file, **kwargs).load()


# torch.load reads the legacy format's magic number with ``pickle_module.load``: restricted too
_PICKLE = types.SimpleNamespace(Unpickler=_Unpickler, load=_restricted_load, __name__="pickle")


def _load_trusted(path: Path) -> Any:
    """Unpickle one DeepSpeed file through the allow-list unpickler.

    DeepSpeed need not be installed and is never imported: its classes (ZeroStageEnum, loss
    scalers, fragment addresses) become attribute bags. Any other global is refused with
    its name.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PICKLE)
    except RefusedGlobalError as err:
        raise ValueError(
            f"{str(path)!r}: {err}. Only import DeepSpeed checkpoints; if this one is genuine "
            "and holds another DeepSpeed class, report it."
        ) from None
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as err:
        raise ValueError(
            f"DeepSpeed checkpoint file {str(path)!r} cannot be read ({type(err).__name__}: "
            f"{err}); it is truncated or corrupted. Copy it again from the run that wrote it."
        ) from err


def _resolve_ds_tag(ds_dir: Path, tag: str | None) -> str:
    if tag is None:
        latest = ds_dir / "latest"
        if not latest.is_file():
            raise ValueError(
                f"DeepSpeed checkpoint dir {str(ds_dir)!r} has no 'latest' file; pass the tag "
                "explicitly (e.g. --tag global_step100)."
            )
        tag = read_tag_file(latest)
    if _model_states_file(inside(ds_dir, tag, "DeepSpeed tag")) is None:
        tags = sorted(d.name for d in ds_dir.iterdir() if _model_states_file(d) is not None)
        raise ValueError(
            f"tag {tag!r} under {str(ds_dir)!r} has neither {MODEL_STATES} nor "
            f"{MODEL_STATES_Z3}; DeepSpeed tags found there: {tags}. Pass one of them "
            "(pipeline checkpoints are not supported by this importer)."
        )
    return tag


def _model_states_file(tag_dir: Path) -> Path | None:
    for name in (MODEL_STATES, MODEL_STATES_Z3):
        if (tag_dir / name).is_file():
            return inside(tag_dir, name, "DeepSpeed model states file")
    return None


def _optim_files(tag_dir: Path) -> list[Path]:
    found = {}
    for f in tag_dir.iterdir():
        m = _OPTIM_RE.match(f.name)
        if m:
            found[int(m.group(1))] = inside(tag_dir, f.name, "DeepSpeed optimizer file")
    if not found or sorted(found) != list(range(len(found))):
        raise ValueError(
            f"{str(tag_dir)!r} holds ZeRO optimizer files for ranks {sorted(found)}; expected "
            "zero_pp_rank_0..N-1_mp_rank_00_optim_states.pt (a ZeRO checkpoint, all ranks)."
        )
    return [found[r] for r in range(len(found))]


def _group_states(base: Any, n_groups: int) -> list[dict[str, Any]]:
    """Per param group, the base optimizer's state of that rank's flat partition."""
    if isinstance(base, dict) and "state" in base:  # a torch optimizer state_dict
        state = base["state"]
        return [dict(state.get(g, {})) for g in range(n_groups)]
    if isinstance(base, list):  # elastic checkpoints: one state dict per group
        return [dict(s) for s in base]
    raise ValueError(f"unrecognised base_optimizer_state of type {type(base).__name__}")


def _json_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else None
    if isinstance(value, (tuple, list)):
        return [_json_value(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return None


def _loss_scaler_state(scaler: Any) -> dict[str, Any]:
    """DeepSpeed's loss scaler object as ShardSpeed's scaler state dict."""
    scale = float(getattr(scaler, "cur_scale", getattr(scaler, "loss_scale", 1.0)))
    dynamic = bool(getattr(scaler, "dynamic", False))
    state: dict[str, Any] = {"loss_scale": scale, "dynamic": dynamic}
    if dynamic:
        state.update(
            cur_iter=int(getattr(scaler, "cur_iter", 0)),
            last_overflow_iter=int(getattr(scaler, "last_overflow_iter", -1)),
            cur_hysteresis=int(getattr(scaler, "cur_hysteresis", 1)),
            num_overflows=0,
        )
    return state


def _split_flat(
    name_shapes: dict[str, Any], parts: list[torch.Tensor], what: str
) -> dict[str, torch.Tensor]:
    """ZeRO-1/2: the ranks' partitions concatenated hold the parameters back to back
    (then padding)."""
    flat = torch.cat([p.detach().reshape(-1).float() for p in parts])
    out, offset = {}, 0
    for name, shape in name_shapes.items():
        numel = int(torch.Size(shape).numel())
        if offset + numel > flat.numel():
            raise ValueError(
                f"{what}: the flat group has {flat.numel()} elements but parameter {name!r} "
                f"needs [{offset}, {offset + numel}); the checkpoint is incomplete or corrupt."
            )
        out[name] = flat[offset : offset + numel].view(-1)
        offset += numel
    return out


def _split_stage3(
    name_shapes: dict[str, Any], parts: list[torch.Tensor], what: str
) -> dict[str, torch.Tensor]:
    """ZeRO-3: every parameter is split on its own; rank r's flat holds, per parameter in
    order, elements [r * c, (r + 1) * c) with c = ceil(numel / world) (the last padded)."""
    flats = [p.detach().reshape(-1).float() for p in parts]
    world = len(flats)
    out, offset = {}, 0
    for name, shape in name_shapes.items():
        numel = int(torch.Size(shape).numel())
        chunk = -(-numel // world)
        if offset + chunk > flats[0].numel():
            raise ValueError(
                f"{what}: the stage-3 flat group has {flats[0].numel()} elements per rank but "
                f"parameter {name!r} needs [{offset}, {offset + chunk}); the checkpoint is "
                "incomplete or corrupt."
            )
        out[name] = torch.cat([f[offset : offset + chunk] for f in flats])[:numel]
        offset += chunk
    return out


def _client_state(model_states: dict[str, Any]) -> dict[str, Any]:
    client: dict[str, Any] = {}
    for key, value in model_states.items():
        if key in _DS_KEYS:
            continue
        try:
            split_client_state({key: value})
        except ValueError:
            logger.warning(f"client_state key {key!r} is not JSON or a tensor; not imported")
            continue
        client[key] = value
    return client


def import_deepspeed_checkpoint(
    ds_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    tag: str | None = None,
    out_tag: str | None = None,
) -> Path:
    """Convert DeepSpeed ZeRO-1/2/3 checkpoint ``ds_dir`` (tag ``tag``, default its ``latest``)
    into a ShardSpeed checkpoint ``<out_dir>/<out_tag>/`` (default: the same tag name).

    Unpickles the DeepSpeed ``.pt`` files through the allow-list unpickler (see the module
    docstring); a file naming any other global raises ``ValueError`` naming it. Returns the written tag directory. The result is a
    world-size-1 stage-0 checkpoint that ``load_checkpoint`` reshards onto any layout.
    RNG states are not in DeepSpeed checkpoints; the converting process's are stored.
    """
    ds_dir, out_dir = Path(ds_dir), Path(out_dir)
    tag = _resolve_ds_tag(ds_dir, tag)
    read = read_deepspeed_tag(ds_dir / tag)
    return write_imported(
        out_dir,
        out_tag or tag,
        read.model,
        read.writer,
        read.scalars,
        read.groups,
        loss_scaler=read.loss_scaler,
        param_order=read.param_order,
    )


@dataclass
class DeepSpeedTag:
    """A DeepSpeed ZeRO tag read into memory: full fp32 tensors per parameter and kind in
    ``writer`` (world-size-1 fragments), the model states dict, and per param group the
    scalar optimizer state and hyperparameters."""

    model: dict[str, Any]
    writer: FragmentWriter
    scalars: list[dict[str, Any]]
    groups: list[dict[str, Any]]
    loss_scaler: Any
    param_order: list[str]
    stage: int
    optimizer: dict[str, Any]  # rank 0's optimizer_state_dict


def read_deepspeed_tag(tag_dir: Path) -> DeepSpeedTag:
    """Read DeepSpeed ZeRO tag ``tag_dir`` (all ranks' files) through the allow-list unpickler."""
    logger.info(f"unpickling DeepSpeed checkpoint {tag_dir} (allow-listed globals only)")
    model = _load_trusted(_model_states_file(tag_dir))
    rank_opts = [_load_trusted(f)["optimizer_state_dict"] for f in _optim_files(tag_dir)]
    stage = int(rank_opts[0].get("zero_stage", 0))
    if stage in (1, 2) and "single_partition_of_fp32_groups" in rank_opts[0]:
        flat_key, base_key, split = (
            "single_partition_of_fp32_groups",
            "base_optimizer_state",
            _split_flat,
        )
    elif stage == 3 and "fp32_flat_groups" in rank_opts[0]:
        flat_key, base_key, split = "fp32_flat_groups", "optimizer_state_dict", _split_stage3
        if model.get("frozen_param_shapes"):
            raise ValueError(
                f"{str(tag_dir)!r} is a ZeRO-3 checkpoint with frozen parameters "
                f"{list(model['frozen_param_shapes'])}; importing those is not supported. "
                "Convert it with DeepSpeed's zero_to_fp32 instead."
            )
    else:
        raise ValueError(
            f"{str(tag_dir)!r} is a ZeRO stage {stage} checkpoint without its flat fp32 groups; "
            "this importer reads ZeRO stages 1, 2 and 3 (fp32 master partitions). Convert other "
            "checkpoints with DeepSpeed's zero_to_fp32 and load the weights."
        )
    param_shapes: list[dict[str, Any]] = model["param_shapes"]
    n_groups = len(param_shapes)
    writer = FragmentWriter()
    scalars: list[dict[str, Any]] = []
    states = [_group_states(o[base_key], n_groups) for o in rank_opts]
    base = rank_opts[0][base_key]
    groups = base.get("param_groups", []) if isinstance(base, dict) else []
    experts = expert_files(tag_dir)
    for g, name_shapes in enumerate(param_shapes):
        ep_size = group_ep_size(groups[g]) if g < len(groups) else 1
        if ep_size > 1 and stage == 3:
            raise ValueError(
                f"{str(tag_dir)!r} is a ZeRO-3 checkpoint with expert-parallel group "
                f"{groups[g].get('name')!r}; importing MoE checkpoints is supported at ZeRO 1/2."
            )
        partition_count = rank_opts[0].get("partition_count")
        count = partition_count[g] if isinstance(partition_count, list) else None
        sources_of = ep_rank_sources(ep_size, len(rank_opts), count if ep_size > 1 else None)
        for ep_rank, ranks in enumerate(sources_of):
            rename = globalise(list(name_shapes), ep_rank) if ep_size > 1 else {}
            sources = {KIND_MASTER: [rank_opts[r][flat_key][g] for r in ranks]}
            for k, v in states[ranks[0]][g].items():
                if isinstance(v, torch.Tensor) and v.numel() == sources[KIND_MASTER][0].numel() > 1:
                    sources[k] = [states[r][g][k] for r in ranks]
            for kind, parts in sources.items():
                for name, t in split(name_shapes, parts, f"group {g} {kind}").items():
                    writer.add(rename.get(name, name), kind, list(name_shapes[name]), 0, t)
        scalars.append(_group_scalars(states[0][g], rank_opts[0][flat_key][g]))
    module = model["module"]
    for name, shape in (model.get("frozen_param_shapes") or {}).items():
        writer.add(name, KIND_PARAM, list(shape), 0, module[name])
    for name in model.get("buffer_names") or []:
        if name in module:
            writer.add(name, KIND_BUFFER, list(module[name].shape), 0, module[name])
    expert_keys = _add_expert_files(writer, experts, model.get("buffer_names") or [])

    return DeepSpeedTag(
        model=model,
        writer=writer,
        scalars=scalars,
        groups=groups,
        loss_scaler=rank_opts[0].get("loss_scaler"),
        param_order=with_expert_keys(list(model["module"].keys()), expert_keys),
        stage=stage,
        optimizer=rank_opts[0],
    )


def write_imported(
    out_dir: Path,
    out_tag: str,
    model: dict[str, Any],
    writer: FragmentWriter,
    scalars: list[dict[str, Any]],
    groups: list[dict[str, Any]],
    *,
    loss_scaler: Any,
    param_order: list[str],
) -> Path:
    """Write what an importer gathered (full fp32 tensors in ``writer``, DeepSpeed's model
    states ``model``) as a world-size-1 stage-0 ShardSpeed checkpoint ``<out_dir>/<out_tag>``."""
    inside(out_dir, out_tag, "output tag")  # written under out_dir, never beside it
    config = model.get("ds_config") or {}
    gas = int(config.get("gradient_accumulation_steps", 1) or 1)
    client = _client_state(model)
    client_json, client_tensors = split_client_state(client)
    stem = rank_stem(0)
    meta = {
        "file": f"{stem}.safetensors",
        "rank": 0,
        "world_size": 1,
        "tensors": writer.entries,
        "client_tensors": sorted(client_tensors),
        "client_state": client_json,
        "optimizer_scalars": scalars,
        "engine": {
            "global_steps": int(model.get("global_steps", 0)),
            "global_samples": int(model.get("global_samples", 0)),
            "micro_steps": int(model.get("global_steps", 0)) * gas,
            "gradient_accumulation_steps": gas,
            "skipped_steps": int(model.get("skipped_steps", 0)),
            "loss_scaler": _loss_scaler_state(loss_scaler),
            "lr_scheduler": model.get("lr_scheduler"),
            "dataloader": None,
            "param_groups": [
                {k: _json_value(v) for k, v in grp.items() if k != "params"} for grp in groups
            ],
            "config": config,
            "stage": 0,
            "dp_world_size": 1,
        },
        "rng": capture_rng_state(),
        "tied_aliases": dict(model.get("shared_params") or {}),
        "param_order": param_order,
    }
    return _write(out_dir, out_tag, meta, {**writer.tensors, **client_tensors})


def _group_scalars(state: dict[str, Any], flat: torch.Tensor) -> dict[str, Any]:
    """The optimizer state of one group that is not per element (Adam's ``step``), as JSON."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and v.numel() == flat.numel() > 1:
            continue
        if isinstance(v, torch.Tensor):
            out[k] = {"value": v.item(), "dtype": dtype_name(v.dtype), "on_param_device": False}
        else:
            out[k] = {"value": _json_value(v)}
    return out


def _add_expert_files(
    writer: FragmentWriter, files: list[Path], buffer_names: list[str]
) -> list[str]:
    """Add what DeepSpeed's per-expert files hold beyond the optimizer's masters (frozen
    expert parameters, expert buffers); return every key they hold (global expert ids)."""
    written = {e["name"] for e in writer.entries}
    buffers = {expert_suffix(n) for n in buffer_names} - {None}
    keys: list[str] = []
    for path in files:
        state = _load_trusted(path)
        if not isinstance(state, dict):
            raise ValueError(
                f"{str(path)!r} holds a {type(state).__name__}, not an expert state dict; the "
                "DeepSpeed checkpoint is corrupt."
            )
        for name, value in state.items():
            keys.append(name)
            if name in written or not isinstance(value, torch.Tensor):
                continue
            kind = KIND_BUFFER if expert_suffix(name) in buffers else KIND_PARAM
            writer.add(name, kind, list(value.shape), 0, value)
    return keys


def _write(out_dir: Path, tag: str, meta: dict[str, Any], tensors: dict[str, Any]) -> Path:
    """Write the tag atomically (tmp dir, manifest last, rename, then ``latest``)."""
    tmp = out_dir / f"{tag}{TMP_MARKER}{uuid.uuid4().hex[:12]}"
    tmp.mkdir(parents=True)
    meta[RANK_FILE_SHA] = write_safetensors(tensors, tmp / meta["file"])
    write_json(tmp / f"{rank_stem(0)}.json", meta)
    _, checksums = read_rank_metas(tmp, 1)
    manifest = {
        "format_version": FORMAT_VERSION,
        "tag": tag,
        "world_size": 1,
        "dp_world_size": 1,
        "stage": 0,
        "global_steps": meta["engine"]["global_steps"],
        "files": [meta["file"]],
        "optimizer_scalars": meta["optimizer_scalars"],
        "tied_aliases": meta["tied_aliases"],
        "param_order": meta["param_order"],
        "index": build_index([meta]),
        CHECKSUMS: checksums,
    }
    write_json(tmp / MANIFEST, seal(manifest))
    final = out_dir / tag
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(out_dir / LATEST, tag)
    logger.info(f"wrote ShardSpeed checkpoint {final}")
    return final

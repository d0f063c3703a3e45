"""``save_checkpoint`` / ``load_checkpoint`` / ``save_16bit_model`` for the training engine.

Save protocol (atomic): rank 0 picks ``<tag>.tmp-<token>/``; every rank snapshots its
tensors to host memory and writes ``rankNNNNN.safetensors`` + ``rankNNNNN.json`` there;
the ranks agree that all of them succeeded, then rank 0 writes ``manifest.json``, renames
the directory to ``<tag>/`` and only then rewrites ``latest``
(:mod:`shardspeed.checkpoint.commit`). With ``async_save`` the writing and the commit run
on a background thread (:mod:`shardspeed.checkpoint.async_save`). A save that dies midway
leaves a ``.tmp-`` directory that loading ignores.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardspeed import comm
from shardspeed.checkpoint.async_save import save_coordinator, wait_pending
from shardspeed.checkpoint.commit import (
    FAULT_ENV,
    RANK_LOCAL_PREFIX,
    commit,
    failed_ranks,
    mesh_shape,
    take_snapshot,
    write_rank_files,
)
from shardspeed.checkpoint.deepspeed_writer import LAYOUTS, DeepSpeedLayoutSpec, layout_spec
from shardspeed.checkpoint.foreign_load import staged_checkpoint
from shardspeed.checkpoint.format import (
    TMP_MARKER,
    join_client_state,
    load_manifest,
    rank_stem,
    read_json,
    resolve_tag,
)
from shardspeed.checkpoint.integrity import verify_tag_distributed
from shardspeed.checkpoint.recovery_script import wants_recovery_script, write_recovery_script
from shardspeed.checkpoint.shards import SliceReader, load_fragments
from shardspeed.checkpoint.state import restore_engine_state, restore_rng_state
from shardspeed.utils.logging import get_logger, log_dist, warning_once

logger = get_logger(__name__)

# "0" makes load_checkpoint (and engine.load_checkpoint) skip the checksum verification
VERIFY_ENV = "SHARDSPEED_CKPT_VERIFY"

__all__ = ["FAULT_ENV", "load_checkpoint", "save_16bit_model", "save_checkpoint", "wait_checkpoint"]


def _rank() -> int:
    return comm.get_rank() if comm.is_initialized() else 0


def _world() -> int:
    return comm.get_world_size() if comm.is_initialized() else 1


def _barrier() -> None:
    if comm.is_initialized() and comm.get_world_size() > 1:
        comm.barrier()


def _shared_token(group: Any) -> str:
    token = [uuid.uuid4().hex[:12] if _rank() == 0 else None]
    if _world() > 1:
        dist.broadcast_object_list(token, src=0, group=group)
    return str(token[0])


def _check_tag(tag: str) -> str:
    if not tag or "/" in tag or os.sep in tag or tag in (".", "..") or TMP_MARKER in tag:
        raise ValueError(
            f"checkpoint tag {tag!r} is not a plain directory name; use e.g. 'global_step100' "
            f"(no path separators, not containing {TMP_MARKER!r})."
        )
    return tag


def _swaps_to_nvme(engine: Any) -> bool:
    """True when masters, optimizer state or parameter shards live in NVMe swap files."""
    offload = getattr(engine, "offload", None)
    return offload is not None and (
        getattr(offload, "optimizer_swapper", None) is not None
        or getattr(offload, "param_swapper", None) is not None
    )


def _fsync_default(engine: Any) -> bool:
    cfg = getattr(getattr(engine, "_config", None), "checkpoint", None)
    return bool(cfg is None or cfg.fsync)


def _verify_default() -> bool:
    """``SHARDSPEED_CKPT_VERIFY=0`` skips checksum verification in ``engine.load_checkpoint``."""
    return os.environ.get(VERIFY_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _async_default(engine: Any) -> bool:
    cfg = getattr(getattr(engine, "_config", None), "checkpoint", None)
    return bool(cfg is not None and cfg.async_enabled)


def _deepspeed_layout(engine: Any, layout: str | None) -> DeepSpeedLayoutSpec | None:
    """The DeepSpeed layout to write next to the native files, or None (native only).

    ``"auto"`` (the default) writes it when the job runs through the compatibility
    distribution (the process imported ``deepspeed`` and it is ShardSpeed): such a job's tools,
    PyTorch Lightning's fp32 conversion or DeepSpeed's own scripts, read DeepSpeed's files.
    Where that layout cannot hold the engine's state (stage 0, fp16, model parallelism,
    experts) "auto" writes the native files alone and says so once.
    """
    if layout is None:
        cfg = getattr(getattr(engine, "_config", None), "checkpoint", None)
        layout = getattr(cfg, "layout", "auto") if cfg is not None else "auto"
    if layout not in LAYOUTS:
        raise ValueError(
            f"save_checkpoint(layout={layout!r}): allowed {list(LAYOUTS)}. Fix: pass 'native' "
            "(ShardSpeed's files only), 'deepspeed' (DeepSpeed's files as well) or 'auto'."
        )
    if layout == "auto":
        if not running_as_deepspeed():
            return None
        try:
            return layout_spec(engine)
        except ValueError as err:
            warning_once(f"checkpoints are written in ShardSpeed's layout only: {err}")
            return None
    return layout_spec(engine) if layout == "deepspeed" else None


def running_as_deepspeed() -> bool:
    """True when ``import deepspeed`` in this process gave ShardSpeed's compatibility
    distribution (it carries ``shardspeed_version``; a real DeepSpeed does not)."""
    import sys

    module = sys.modules.get("deepspeed")
    return module is not None and hasattr(module, "shardspeed_version")


def save_checkpoint(
    engine: Any,
    save_dir: str | os.PathLike[str],
    tag: str | None = None,
    client_state: dict[str, Any] | None = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
    async_save: bool | None = None,
    layout: str | None = None,
) -> bool:
    """Save a resumable, topology-independent checkpoint of ``engine``; every rank must call it.

    Writes ``<save_dir>/<tag>/`` (default tag ``global_step{N}``) atomically and, with
    ``save_latest``, points ``<save_dir>/latest`` at it. ``client_state`` may hold JSON
    values and tensors; it is returned by :func:`load_checkpoint`.

    ``async_save`` (default: the config's ``checkpoint.async_save``, or DeepSpeed's
    ``checkpoint.writer.decoupled``) returns once every tensor is copied to host memory;
    the files are written and the tag published in the background. A previous async save
    is waited for first, and if it failed its :class:`CheckpointError` is raised here
    (nothing new is saved).

    ``layout`` (default: the config's ``checkpoint.layout``, ``"auto"``): ``"deepspeed"``
    also writes DeepSpeed 0.19's ``.pt`` files into the tag, so DeepSpeed's
    ``load_checkpoint``, ``zero_to_fp32`` and PyTorch Lightning read it (ZeRO 1-3, fp32/bf16,
    data parallelism only; see ``docs/checkpoints.md``).
    """
    wait_pending(engine)
    deepspeed_layout = _deepspeed_layout(engine, layout)
    if async_save is None:
        async_save = _async_default(engine)
    tag = _check_tag(str(tag) if tag is not None else f"global_step{engine.global_steps}")
    save_dir = Path(save_dir)
    saver = save_coordinator(engine)
    rank, world = _rank(), _world()
    tmp = save_dir / f"{tag}{TMP_MARKER}{_shared_token(saver.group)}"
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        snap = take_snapshot(
            engine,
            save_dir,
            tmp,
            tag,
            rank=rank,
            world_size=world,
            client_state=client_state or {},
            save_latest=save_latest,
            exclude_frozen=exclude_frozen_parameters,
            # a synchronous save writes before training resumes: host tensors need no copy,
            # unless they are NVMe swap buffers that are reused once the snapshot is taken
            copy=async_save or _swaps_to_nvme(engine),
            fsync=_fsync_default(engine),
        )
        snap.deepspeed_layout = deepspeed_layout
    except Exception:
        failed_ranks(False, rank, world, saver.group)  # the others' commit fails, not hangs
        raise
    if rank == 0 and wants_recovery_script(engine.stage, engine.bfloat16_enabled()):
        write_recovery_script(save_dir)  # DeepSpeed's zero_to_fp32.py next to the tags
    if async_save:
        saver.submit(snap)
        log_dist(f"saving checkpoint {save_dir / tag} in the background")
        return True
    write_error: BaseException | None = None
    try:
        write_rank_files(snap)
    except Exception as err:  # every rank learns about it in commit() and raises
        write_error = err
    commit(snap, write_error, saver.group)
    log_dist(f"saved checkpoint {save_dir / tag}")
    return True


def wait_checkpoint(engine: Any) -> None:
    """Block until ``engine``'s asynchronous save (if any) is published on every rank.

    Raises :class:`~shardspeed.checkpoint.commit.CheckpointError` if it failed on any rank
    (its tag was then not published; the previous checkpoint and ``latest`` are intact).
    """
    wait_pending(engine)


def load_checkpoint(
    engine: Any,
    load_dir: str | os.PathLike[str],
    tag: str | None = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    *,
    verify_checksums: bool | None = None,
    restore_rng: bool = False,
) -> tuple[str | None, dict[str, Any] | None]:
    """Load a checkpoint saved at any world size / ZeRO stage 0-3 / pipeline layout into ``engine``.

    Also loads a DeepSpeed ZeRO tag (when ``load_dir`` has no finished native tag) and, with
    the config's ``checkpoint.load_universal``, a universal checkpoint folder: each is
    converted to a temporary native checkpoint first (:mod:`shardspeed.checkpoint.foreign_load`).

    Returns ``(path, client_state)``, or ``(None, None)`` (with a warning) when
    ``load_dir`` holds no finished checkpoint. Every rank file's sha256 is verified first
    (the ranks share the work) unless ``verify_checksums`` is False (default: True, or
    False when the environment sets ``SHARDSPEED_CKPT_VERIFY=0``).

    ``restore_rng``: also restore each rank's global torch (and CUDA) RNG state saved with
    the checkpoint, when the layout is unchanged, for an exact resume (with the dataloader's
    ``exact_resume``). Default False, as DeepSpeed, which restores no RNG state
    (``engine.load_checkpoint`` never does).
    """
    wait_pending(engine, raise_error=False)  # the save may target load_dir; log a failure
    load_dir = Path(load_dir)
    # a DeepSpeed ZeRO tag or universal folder is converted to a temporary native one first
    with staged_checkpoint(engine, load_dir, tag) as (native_dir, native_tag):
        path, client = _load_native(
            engine,
            native_dir,
            native_tag,
            load_module_strict,
            load_optimizer_states,
            load_module_only,
            load_lr_scheduler_states,
            verify_checksums=verify_checksums,
            restore_rng=restore_rng,
        )
    if path is not None and native_dir != load_dir:
        path = str(load_dir / Path(path).name)
    return path, client


def _load_native(
    engine: Any,
    load_dir: Path,
    tag: str | None,
    load_module_strict: bool,
    load_optimizer_states: bool,
    load_module_only: bool,
    load_lr_scheduler_states: bool,
    *,
    verify_checksums: bool | None,
    restore_rng: bool,
) -> tuple[str | None, dict[str, Any] | None]:
    """:func:`load_checkpoint` of a native ShardSpeed tag."""
    tag = resolve_tag(load_dir, tag)
    if tag is None:
        logger.warning(f"no finished checkpoint under {load_dir}; nothing loaded")
        return None, None
    tag_dir = load_dir / tag
    manifest = load_manifest(tag_dir)
    rank = _rank()
    if _verify_default() if verify_checksums is None else verify_checksums:
        group = save_coordinator(engine).group
        verify_tag_distributed(tag_dir, manifest, rank=rank, world_size=_world(), group=group)
    # rank-local state (RNG, 1-bit optimizer error feedback) is reused only on the same mesh
    mesh = manifest.get("mesh")  # absent in checkpoints saved before it was recorded
    same_topology = manifest["world_size"] == _world() and mesh in (None, mesh_shape(engine))
    own = read_json(tag_dir / f"{rank_stem(rank if same_topology else 0)}.json")
    reader = SliceReader(tag_dir)
    optimizer_states = load_optimizer_states and not load_module_only
    load_fragments(
        engine, reader, manifest, optimizer_states=optimizer_states, strict=load_module_strict
    )
    _load_rank_local(engine, reader, own if same_topology and optimizer_states else None)
    engine.publish_params()  # masters -> parameter shards -> usable parameters
    client = {k: reader.read(own["file"], k, 0, None) for k in own["client_tensors"]}
    if not load_module_only:
        restore_engine_state(
            engine,
            own["engine"],
            optimizer_states=optimizer_states,
            scheduler_states=load_lr_scheduler_states,
        )
        if same_topology and restore_rng:
            restore_rng_state(own["rng"])
    _barrier()
    log_dist(
        f"loaded checkpoint {tag_dir} (saved at world {manifest['world_size']} stage "
        f"{manifest['stage']} mesh {mesh}; now world {_world()} stage {engine.stage} mesh "
        f"{mesh_shape(engine)})"
    )
    return str(tag_dir), join_client_state(own["client_state"], client)


def save_16bit_model(
    engine: Any,
    save_dir: str | os.PathLike[str],
    save_filename: str = "pytorch_model.bin",
    exclude_frozen_parameters: bool = False,
) -> bool:
    """Write the full model in its training dtype on rank 0 (``.safetensors`` or torch.save).

    At ZeRO stage 3 every rank must call it: the parameters are gathered first, and only if
    ``zero_optimization.stage3_gather_16bit_weights_on_model_save`` is true; otherwise
    nothing is written and False is returned (with a warning), as in DeepSpeed.
    """
    path = Path(save_dir) / save_filename
    if getattr(engine, "stage", 0) == 3:
        if not engine._config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
            logger.warning(
                "save_16bit_model: ZeRO stage 3 keeps only parameter shards and "
                "zero_optimization.stage3_gather_16bit_weights_on_model_save is false, so "
                f"nothing was written to {path}. Set it to true to gather the full weights, or "
                "save a checkpoint and convert it with get_fp32_state_dict_from_checkpoint."
            )
            return False
    from shardspeed.checkpoint.model_export import export_state_dict

    state = export_state_dict(engine, exclude_frozen_parameters)
    if state is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        if save_filename.endswith(".safetensors"):
            from safetensors.torch import save_file

            save_file(state, str(tmp), metadata={"format": "pt"})
        else:
            torch.save(state, tmp)
        os.replace(tmp, path)
    _barrier()
    return True


def _load_rank_local(engine: Any, reader: Any, own: dict[str, Any] | None) -> None:
    """Give a 1-bit optimizer its per-rank state back (None: another layout, start fresh)."""
    hook = getattr(engine.basic_optimizer, "load_rank_local_state", None)
    if hook is None:
        return
    if own is None or not own.get("rank_local_tensors"):
        hook(None)
        return
    n = len(RANK_LOCAL_PREFIX)
    hook({k[n:]: reader.read(own["file"], k, 0, None) for k in own["rank_local_tensors"]})

"""One rank's part of a save, and the commit that publishes a tag only when every rank wrote.

A save is three steps, shared by the synchronous and the asynchronous path:

1. :func:`take_snapshot` (training thread): every tensor this rank saves is copied to host
   memory and every piece of engine state is captured as JSON, so training may change
   parameters, optimizer state and counters as soon as it returns.
2. :func:`write_rank_files`: ``rankNNNNN.safetensors`` + ``rankNNNNN.json`` into the
   ``<tag>.tmp-<token>/`` directory (on the background thread for an async save).
3. :func:`commit`: the ranks agree that all of them wrote (one all-reduce of a per-rank
   failure vector); only then rank 0 writes ``manifest.json``, renames the directory to
   ``<tag>/`` and rewrites ``latest``; a second agreement tells every rank whether that
   worked. A failure anywhere (or a rank that never arrives) publishes nothing.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardspeed.checkpoint.deepspeed_writer import DeepSpeedLayoutSpec, write_deepspeed_files
from shardspeed.checkpoint.expert_placement import ExpertNames
from shardspeed.checkpoint.format import (
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    TMP_MARKER,
    build_index,
    parse_json,
    rank_stem,
    split_client_state,
    write_json,
)
from shardspeed.checkpoint.integrity import CHECKSUMS, RANK_FILE_SHA, seal, sha256_hex
from shardspeed.checkpoint.safetensors_io import write_safetensors
from shardspeed.checkpoint.shards import FragmentWriter, collect_fragments, tied_aliases
from shardspeed.checkpoint.state import capture_engine_state, capture_rng_state
from shardspeed.utils.io import atomic_write_text

# "after_rank_files" (every rank) or "after_rank_files:1,3" (those ranks) raise right after
# writing their files, before the commit: a test hook for failed saves.
FAULT_ENV = "SHARDSPEED_CKPT_FAULT"


class CheckpointError(RuntimeError):
    """A save did not complete on every rank; its tag was not published."""


@dataclass
class RankSnapshot:
    """Everything one rank writes for one tag, already detached from the live engine."""

    save_dir: Path
    tmp: Path  # <save_dir>/<tag>.tmp-<token>/
    tag: str
    rank: int
    world_size: int
    save_latest: bool
    tensors: dict[str, torch.Tensor]  # host copies
    meta: dict[str, Any]  # the rank JSON
    manifest_fields: dict[str, Any] = field(default_factory=dict)
    fsync: bool = True  # rank files reach the disk before the tag is published
    # rank 0 also writes DeepSpeed's files into the tag before publishing it
    deepspeed_layout: DeepSpeedLayoutSpec | None = None

    @property
    def final(self) -> Path:
        return self.save_dir / self.tag


def take_snapshot(
    engine: Any,
    save_dir: Path,
    tmp: Path,
    tag: str,
    *,
    rank: int,
    world_size: int,
    client_state: dict[str, Any],
    save_latest: bool,
    exclude_frozen: bool,
    copy: bool = True,
    fsync: bool = True,
) -> RankSnapshot:
    """Capture this rank's tensors and its engine state as JSON.

    With ``copy`` every tensor is copied to host memory, so training may change the
    parameters right away (asynchronous save); without it host tensors are referenced as
    they are, for a save that writes them before training resumes.
    """
    client_json, client_tensors = split_client_state(client_state)
    writer = FragmentWriter(copy=copy)
    scalars = collect_fragments(engine, writer, exclude_frozen=exclude_frozen)
    writer.synchronize()  # device -> host copies are complete before training resumes
    rank_local = _rank_local_tensors(engine)
    experts = ExpertNames.of(engine.module)
    aliases = tied_aliases(engine.module).items()
    stem = rank_stem(rank)
    meta = {
        "file": f"{stem}.safetensors",
        "rank": rank,
        "world_size": world_size,
        "tensors": writer.entries,
        "client_tensors": sorted(client_tensors),
        "rank_local_tensors": sorted(rank_local),
        "client_state": client_json,
        "optimizer_scalars": scalars,
        "engine": capture_engine_state(engine),
        "rng": capture_rng_state(),
        # every rank names its own module's parameters: a pipeline stage holds only some;
        # experts under their global ids, every global expert listed
        "tied_aliases": {experts.global_name(a): experts.global_name(n) for a, n in aliases},
        "param_order": experts.global_order(list(engine.module.state_dict().keys())),
    }
    return RankSnapshot(
        save_dir=save_dir,
        tmp=tmp,
        tag=tag,
        rank=rank,
        world_size=world_size,
        save_latest=save_latest,
        tensors={**writer.tensors, **client_tensors, **rank_local},
        meta=meta,
        manifest_fields={
            "dp_world_size": engine.dp_world_size,
            "stage": engine.stage,
            "global_steps": engine.global_steps,
            "mesh": mesh_shape(engine),
        },
        fsync=fsync,
    )


RANK_LOCAL_PREFIX = "rank_local/"
MESH_AXES = ("pipe", "data", "sequence", "tensor")


def mesh_shape(engine: Any) -> dict[str, int] | None:
    """The engine's mesh degrees by axis (recorded in the manifest), or None without one."""
    topology = getattr(engine, "topology", None)
    return None if topology is None else {axis: topology.size(axis) for axis in MESH_AXES}


def _rank_local_tensors(engine: Any) -> dict[str, torch.Tensor]:
    """State only this rank holds (a 1-bit optimizer's error feedback), by key, host copies."""
    hook = getattr(getattr(engine, "basic_optimizer", None), "rank_local_state", None)
    if hook is None:
        return {}
    return {
        RANK_LOCAL_PREFIX + name: t.detach().to("cpu", copy=True).reshape(-1).contiguous()
        for name, t in hook().items()
    }


def _fault_ranks() -> set[int] | None:
    """Ranks that simulate a crash after writing (None: no fault configured)."""
    value = os.environ.get(FAULT_ENV, "")
    if not value.startswith("after_rank_files"):
        return None
    _, _, ranks = value.partition(":")
    return {int(r) for r in ranks.split(",") if r.strip()} if ranks else set()


def write_rank_files(snap: RankSnapshot) -> None:
    """Write this rank's safetensors file (fsynced unless the config says not to) and JSON
    into the tag's temp directory."""
    path = snap.tmp / snap.meta["file"]
    snap.meta[RANK_FILE_SHA] = write_safetensors(snap.tensors, path, fsync=snap.fsync)
    write_json(snap.tmp / f"{rank_stem(snap.rank)}.json", snap.meta)
    faulty = _fault_ranks()
    if faulty is not None and (not faulty or snap.rank in faulty):
        raise RuntimeError(f"{FAULT_ENV}=after_rank_files: simulated crash during save")


def failed_ranks(ok: bool, rank: int, world_size: int, group: Any) -> list[int]:
    """All-reduce a failure vector over ``group``: the ranks that reported ``ok=False``.

    Calls ``torch.distributed`` directly: on the asynchronous path it runs on the writer
    thread over the checkpoint group and must stay out of the training comms accounting.
    """
    flags = torch.zeros(world_size, dtype=torch.int32)
    flags[rank] = 0 if ok else 1
    if world_size > 1:
        dist.all_reduce(flags, group=group)
    return [r for r in range(world_size) if flags[r]]


def commit(snap: RankSnapshot, write_error: BaseException | None, group: Any) -> None:
    """Publish the tag if every rank wrote its files; raise :class:`CheckpointError` if not.

    Collective over ``group`` (every rank of the world); every rank raises on failure.
    """
    failed = failed_ranks(write_error is None, snap.rank, snap.world_size, group)
    if failed:
        raise _error(snap, failed, write_error, "writing their files")
    final_error: BaseException | None = None
    if snap.rank == 0:
        try:
            finalise(snap)
        except Exception as err:  # reported to every rank below
            final_error = err
    failed = failed_ranks(final_error is None, snap.rank, snap.world_size, group)
    if failed:
        raise _error(snap, failed, final_error, "publishing the tag")


def _error(
    snap: RankSnapshot, failed: list[int], own: BaseException | None, what: str
) -> CheckpointError:
    detail = f"this rank: {type(own).__name__}: {own}" if own is not None else "see their logs"
    err = CheckpointError(
        f"checkpoint {snap.final} was not saved: rank(s) {failed} failed {what} ({detail}). "
        f"The previous tags and {LATEST!r} are unchanged; the partial directory {snap.tmp} can "
        "be deleted. Fix the cause (disk space, permissions) and save again."
    )
    err.__cause__ = own
    return err


def read_rank_metas(tmp: Path, world_size: int) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every rank's JSON, and ``{file name: sha256}`` of each rank's two files: the JSON's
    from the bytes read here, the safetensors file's as its rank recorded it."""
    metas, checksums = [], {}
    for r in range(world_size):
        path = tmp / f"{rank_stem(r)}.json"
        data = path.read_bytes()
        meta = parse_json(data, path)
        checksums[path.name] = sha256_hex(data)
        checksums[meta["file"]] = meta[RANK_FILE_SHA]
        metas.append(meta)
    return metas, checksums


def finalise(snap: RankSnapshot) -> None:
    """Rank 0, after every rank wrote: manifest, rename ``<tag>.tmp-*`` -> ``<tag>``, latest."""
    metas, checksums = read_rank_metas(snap.tmp, snap.world_size)
    param_order: dict[str, None] = {}  # ordered union over ranks (pipeline stages)
    aliases: dict[str, str] = {}
    for meta in metas:
        param_order.update(dict.fromkeys(meta.get("param_order", [])))
        aliases.update(meta.get("tied_aliases", {}))
    manifest = {
        "format_version": FORMAT_VERSION,
        "tag": snap.tag,
        "world_size": snap.world_size,
        **snap.manifest_fields,
        "files": [m["file"] for m in metas],
        "optimizer_scalars": metas[0]["optimizer_scalars"],
        "tied_aliases": aliases,
        "param_order": list(param_order),
        "index": build_index(metas),
        CHECKSUMS: checksums,
    }
    write_json(snap.tmp / MANIFEST, seal(manifest))
    if snap.deepspeed_layout is not None:
        write_deepspeed_files(snap.tmp, manifest, metas[0], snap.deepspeed_layout)
    old = None
    if snap.final.exists():  # re-saving a tag: swap, then delete the old copy
        old = snap.save_dir / f"{snap.tag}{TMP_MARKER}old-{uuid.uuid4().hex[:8]}"
        os.replace(snap.final, old)
    os.replace(snap.tmp, snap.final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if snap.save_latest:
        atomic_write_text(snap.save_dir / LATEST, snap.tag)

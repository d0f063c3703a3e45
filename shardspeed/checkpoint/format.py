"""On-disk layout of an engine checkpoint: names, tensor keys, manifest and tag resolution.

A checkpoint tag is a directory ``<save_dir>/<tag>/`` holding, per rank ``r``,
``rank{r:05d}.safetensors`` (tensors only) and ``rank{r:05d}.json`` (what each tensor is
plus the rank's engine state), and ``manifest.json`` (written last, by rank 0) that
indexes every tensor fragment of every rank by parameter name and kind. A tag without a
manifest is incomplete and never loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from shardspeed.checkpoint.integrity import (
    CheckpointIntegrityError,
    check_file_names,
    check_seal,
    inside,
    read_tag_file,
)
from shardspeed.checkpoint.tp_placement import add_to_index, sort_pieces
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
TMP_MARKER = ".tmp-"

# kinds of tensor entries that are not optimizer state
KIND_MASTER = "master"  # fp32 master fragment of a trainable parameter
KIND_PARAM = "param"  # full frozen parameter (rank 0)
KIND_BUFFER = "buffer"  # full persistent buffer (rank 0)
KIND_CLIENT = "client"  # a tensor from client_state
NON_OPTIMIZER_KINDS = frozenset({KIND_MASTER, KIND_PARAM, KIND_BUFFER, KIND_CLIENT})


def rank_stem(rank: int) -> str:
    return f"rank{rank:05d}"


def tensor_key(name: str, kind: str, start: int, end: int, tp_rank: int | None = None) -> str:
    """The safetensors key of one fragment: elements [start, end) of flattened ``name`` (of
    tensor rank ``tp_rank``'s shard of it, for a tensor-parallel parameter)."""
    if tp_rank is not None:
        return f"{name}|{kind}|tp{tp_rank}|{start}-{end}"
    return f"{name}|{kind}|{start}-{end}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"checkpoint names an unknown dtype {name!r}")
    return dtype


def write_json(path: Path, data: Any) -> None:
    from shardspeed.utils.io import atomic_write_text

    atomic_write_text(path, json.dumps(data, indent=1, sort_keys=False))


def read_json(path: Path) -> Any:
    return parse_json(path.read_bytes(), path)


def parse_json(data: bytes, path: Path) -> Any:
    """``data`` (the bytes of ``path``) as JSON; a clear error when it is not."""
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointIntegrityError(
            f"{str(path)!r} is not valid JSON ({err}); the file is corrupt or truncated. "
            "Restore it from a copy or load another tag."
        ) from None


def is_complete(tag_dir: Path) -> bool:
    """True when ``tag_dir`` is a finished checkpoint (its manifest exists)."""
    return (tag_dir / MANIFEST).is_file() and TMP_MARKER not in tag_dir.name


def complete_tags(ckpt_dir: Path) -> list[str]:
    """Finished tags under ``ckpt_dir``, oldest first (by manifest modification time)."""
    if not ckpt_dir.is_dir():
        return []
    tags = [d for d in ckpt_dir.iterdir() if d.is_dir() and is_complete(d)]
    tags.sort(key=lambda d: (d / MANIFEST).stat().st_mtime_ns)
    return [d.name for d in tags]


def resolve_tag(ckpt_dir: str | Path, tag: str | None) -> str | None:
    """The tag to load: ``tag`` if given (must be complete), else ``latest``, else the newest.

    Returns None when ``ckpt_dir`` holds no finished checkpoint. A ``latest`` that names
    an incomplete tag (a save that died midway) falls back to the newest complete tag.
    """
    ckpt_dir = Path(ckpt_dir)
    if tag is not None:
        if not is_complete(inside(ckpt_dir, str(tag), "checkpoint tag")):
            raise ValueError(
                f"checkpoint tag {tag!r} under {str(ckpt_dir)!r} is missing or incomplete (no "
                f"{MANIFEST}); finished tags there: {complete_tags(ckpt_dir)}. Pass one of them "
                "or tag=None for the latest."
            )
        return str(tag)
    latest = ckpt_dir / LATEST
    if latest.is_file():
        name = read_tag_file(latest)
        if name and is_complete(inside(ckpt_dir, name, f"tag named by {str(latest)!r}")):
            return name
        logger.warning(
            f"{latest} names {name!r}, which is incomplete; using the newest finished tag"
        )
    tags = complete_tags(ckpt_dir)
    return tags[-1] if tags else None


def load_manifest(tag_dir: Path) -> dict[str, Any]:
    """The tag's manifest, checked: its version, its own checksum (an old manifest without
    checksums loads with a warning) and that every file it names lies inside ``tag_dir``."""
    path = inside(tag_dir, MANIFEST, "manifest")
    manifest = read_json(path)
    if not isinstance(manifest, dict):
        raise CheckpointIntegrityError(
            f"{str(path)!r} holds a {type(manifest).__name__}, not a JSON object; the manifest "
            "is corrupt. Restore it from a copy or load another tag."
        )
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{tag_dir / MANIFEST} has format_version={version!r}; this ShardSpeed reads "
            f"version {FORMAT_VERSION}. Convert it with a matching ShardSpeed release."
        )
    check_seal(manifest, path)
    check_file_names(tag_dir, manifest)
    return manifest


def build_index(rank_metas: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{name: {"shape", "dtype", "kinds": {kind: [[file, key, start, end], ...]}}}``.

    Fragments of tensor-parallel shards (entries with ``"tp"``) are filed per tensor rank
    under the entry's ``"tp"`` (:mod:`shardspeed.checkpoint.tp_placement`).
    """

    index: dict[str, dict[str, Any]] = {}
    seen: set[str] = set()  # tensor keys already indexed
    for meta in rank_metas:
        for entry in meta["tensors"]:
            if entry["kind"] == KIND_CLIENT:
                continue
            item = index.setdefault(
                entry["name"], {"shape": entry["shape"], "dtype": entry["dtype"], "kinds": {}}
            )
            if entry["kind"] == KIND_MASTER or entry["kind"] in (KIND_PARAM, KIND_BUFFER):
                item["dtype"] = entry["dtype"]
            if entry["key"] in seen:
                continue  # the same range saved by two ranks (a buffer of a tied module)
            seen.add(entry["key"])
            piece = [meta["file"], entry["key"], entry["start"], entry["end"]]
            if "tp" in entry:
                add_to_index(item, entry, piece)
            else:
                item["kinds"].setdefault(entry["kind"], []).append(piece)
    for item in index.values():
        for pieces in item["kinds"].values():
            pieces.sort(key=lambda p: p[2])
        sort_pieces(item)
    return index


def overlapping(
    pieces: list[list[Any]], start: int, end: int
) -> list[tuple[str, str, int, int, int]]:
    """Saved pieces intersecting [start, end) of a flattened tensor.

    Returns ``(file, key, piece_lo, piece_hi, dest_offset)``: elements
    [piece_lo, piece_hi) of the stored piece land at ``dest_offset`` relative to ``start``.
    """
    hits = []
    for file, key, p_lo, p_hi in pieces:
        lo, hi = max(start, p_lo), min(end, p_hi)
        if lo < hi:
            hits.append((file, key, lo - p_lo, hi - p_lo, lo - start))
    return hits


# -- client state ---------------------------------------------------------------------------
def split_client_state(state: Any, path: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """JSON-able copy of ``state`` with tensors replaced by ``{"__tensor__": key}``."""
    tensors: dict[str, torch.Tensor] = {}
    if isinstance(state, torch.Tensor):
        key = f"__client__|{path}"
        tensors[key] = state.detach().to("cpu", copy=True).contiguous()  # a snapshot
        return {"__tensor__": key}, tensors
    if isinstance(state, dict):
        out = {}
        for k, v in state.items():
            if not isinstance(k, str):
                raise ValueError(
                    f"client_state key {k!r} at {path or '<top>'} is a {type(k).__name__}; "
                    "checkpoint client state needs string keys (JSON). Convert the key to str."
                )
            out[k], sub = split_client_state(v, f"{path}.{k}" if path else k)
            tensors.update(sub)
        return out, tensors
    if isinstance(state, (list, tuple)):
        items = []
        for i, v in enumerate(state):
            item, sub = split_client_state(v, f"{path}[{i}]")
            items.append(item)
            tensors.update(sub)
        return items, tensors
    try:
        json.dumps(state)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"client_state value at {path or '<top>'} ({type(state).__name__}) is not JSON-"
            "serialisable or a tensor; checkpoints never pickle. Store plain numbers/strings/"
            "lists/dicts or tensors."
        ) from err
    return state, tensors


def join_client_state(state: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(state, dict):
        if set(state) == {"__tensor__"}:
            return tensors[state["__tensor__"]]
        return {k: join_client_state(v, tensors) for k, v in state.items()}
    if isinstance(state, list):
        return [join_client_state(v, tensors) for v in state]
    return state

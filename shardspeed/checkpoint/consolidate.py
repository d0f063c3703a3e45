"""Consolidate an engine checkpoint into a plain fp32 state dict, one tensor at a time.

Nothing here needs ``torch.distributed`` or the model: tensors are assembled from the
manifest's fragment index, opening rank files lazily, so a checkpoint saved on any
number of ranks converts on one CPU.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from shardspeed.checkpoint.format import (
    KIND_BUFFER,
    KIND_MASTER,
    KIND_PARAM,
    load_manifest,
    resolve_tag,
)
from shardspeed.checkpoint.integrity import verify_tag
from shardspeed.checkpoint.safetensors_io import write_safetensors
from shardspeed.checkpoint.shards import SliceReader
from shardspeed.utils.io import atomic_write_text

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000; ``"512MiB"`` -> 536_870_912; ints pass through."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    if not match or int(float(match.group(1))) <= 0:
        raise ValueError(
            f"max_shard_size={text!r} is not a positive size; use e.g. '5GB', '500MB', '1GiB'."
        )
    unit = match.group(2).upper()
    base = 1024 if "I" in unit else 1000
    power = "KMGT".find(unit[:1]) + 1 if unit[:1] in "KMGT" and unit[:1] else 0
    return int(float(match.group(1)) * base**power)


def _tag_dir(checkpoint_dir: str | os.PathLike[str], tag: str | None) -> Path:
    ckpt = Path(checkpoint_dir)
    resolved = resolve_tag(ckpt, tag)
    if resolved is None:
        raise ValueError(
            f"checkpoint_dir={str(ckpt)!r} holds no finished checkpoint (no tag directory with "
            "a manifest.json); pass the directory given to save_checkpoint."
        )
    return ckpt / resolved


def iter_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    *,
    verify_checksums: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` in the model's state-dict order, assembling one at a time.

    Floating tensors come out in fp32 (trainable parameters from their fp32 masters);
    tied aliases yield the same tensor under each name. With ``verify_checksums`` every
    rank file's sha256 is checked against the manifest before the first tensor is read.
    """
    tag_dir = _tag_dir(checkpoint_dir, tag)
    manifest = load_manifest(tag_dir)
    if verify_checksums:
        verify_tag(tag_dir, manifest)
    index = manifest["index"]
    aliases = manifest.get("tied_aliases", {})
    cache: dict[str, torch.Tensor] = {}  # canonical tensors still needed by a later alias
    pending = set(aliases.values())
    for name in manifest.get("param_order") or list(index):
        source = aliases.get(name, name)
        if source in cache:
            yield name, cache[source]
            continue
        entry = index.get(source)
        if entry is None:
            continue  # e.g. frozen parameters excluded at save time
        kind = next(
            (k for k in (KIND_MASTER, KIND_PARAM, KIND_BUFFER) if k in entry["kinds"]), None
        )
        if kind is None:
            continue
        # A fresh reader per tensor: closing it unmaps the rank files, so pages touched for
        # one tensor do not stay resident (and count towards RSS) for the whole conversion.
        tensor = SliceReader(tag_dir).full(entry, kind, source)
        if tensor.is_floating_point():
            tensor = tensor.float()
        if source in pending:
            cache[source] = tensor
        yield name, tensor


def get_fp32_state_dict_from_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    *,
    verify_checksums: bool = True,
) -> dict[str, torch.Tensor]:
    """The full fp32 state dict of a checkpoint (loads with ``model.load_state_dict``).

    ``verify_checksums=False`` skips the sha256 check of the rank files (faster, trusted
    storage only)."""
    state = dict(iter_fp32_state_dict(checkpoint_dir, tag, verify_checksums=verify_checksums))
    if not state:
        raise ValueError(
            f"checkpoint {str(checkpoint_dir)!r} (tag {tag!r}) yielded no tensors; refusing to "
            "return an empty state dict. Check the directory and tag."
        )
    return state


def convert_to_fp32_files(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    safetensors: bool = True,
    max_shard_size: str | int = "5GB",
    verify_checksums: bool = True,
) -> list[Path]:
    """Stream the fp32 weights into shards of at most ``max_shard_size`` (+ HF index json).

    One shard is written as ``model.safetensors`` / ``pytorch_model.bin``; several as
    ``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json``. The rank
    files' checksums are verified first unless ``verify_checksums`` is False.
    """
    limit = parse_size(max_shard_size)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    prefix, ext = ("model", "safetensors") if safetensors else ("pytorch_model", "bin")
    shards: list[tuple[Path, list[str]]] = []
    current: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal current, size
        if not current:
            return
        path = out / f".{prefix}-part{len(shards):05d}.{ext}.tmp"
        if safetensors:
            write_safetensors(current, path, {"format": "pt"})
        else:
            torch.save(current, path)
        shards.append((path, list(current)))
        current, size = {}, 0

    for name, tensor in iter_fp32_state_dict(
        checkpoint_dir, tag, verify_checksums=verify_checksums
    ):
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > limit:
            flush()
        current[name] = tensor.clone() if any(t is tensor for t in current.values()) else tensor
        size += nbytes
        total += nbytes
    flush()
    if not shards:
        raise ValueError(
            f"checkpoint {str(checkpoint_dir)!r} yielded no tensors; refusing to write an empty "
            f"model to {str(out)!r}."
        )
    if len(shards) == 1:
        final = out / f"{prefix}.{ext}"
        os.replace(shards[0][0], final)
        return [final]
    written, weight_map = [], {}
    for i, (path, names) in enumerate(shards):
        final = out / f"{prefix}-{i + 1:05d}-of-{len(shards):05d}.{ext}"
        os.replace(path, final)
        written.append(final)
        weight_map.update({n: final.name for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    index_path = out / f"{prefix}.{ext}.index.json"
    atomic_write_text(index_path, json.dumps(index, indent=2))
    return [*written, index_path]

"""What a load may trust: checksums of every file of a tag, and paths that stay inside it.

Checksums (recorded at save, verified at load)::

    rankNNNNN.safetensors --sha256, hashed while streaming--> rankNNNNN.json  "sha256"
    rankNNNNN.json        --sha256, hashed by rank 0------->  manifest.json   "checksums"
    manifest.json         --sha256 of its canonical JSON--->  manifest.json   "manifest_sha256"

Every byte of every rank file (safetensors header and data, rank JSON) is covered by
``manifest["checksums"]``; the manifest seals itself with the digest of its own content
(``json.dumps(sort_keys=True)`` without the seal), so a flipped byte in it is detected too
(a flip that keeps the JSON identical, e.g. in indentation, changes nothing that is read).
A manifest with neither field was written before checksums existed: it loads with a
warning. A manifest with only one of them is corrupt.

Paths: every name a load takes from outside the code (the ``tag`` argument, the ``latest``
file, the manifest's file entries, a rank JSON's ``file``) must resolve to a path inside
its directory: no absolute paths, no ``..``, no symlink that points elsewhere.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
import torch.distributed as dist

from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

CHECKSUMS = "checksums"  # manifest: {file name: sha256 hex} of every rank file
MANIFEST_SHA = "manifest_sha256"  # manifest: sha256 of its own canonical JSON, seal excluded
RANK_FILE_SHA = "sha256"  # rank JSON: sha256 of the rank's safetensors file
_CHUNK = 8 << 20  # bytes read at a time while hashing


class CheckpointIntegrityError(ValueError):
    """A checkpoint file is corrupt, truncated, tampered with, or points outside its folder."""


# -- paths ----------------------------------------------------------------------------------
def inside(root: Path, name: str, what: str) -> Path:
    """``root / name``, refused unless it is relative, has no ``..`` and resolves (following
    symlinks) to a path inside ``root``."""
    text = str(name)
    parts = PurePosixPath(text.replace("\\", "/")).parts
    if (
        not text.strip()
        or "\x00" in text
        or PurePosixPath(text).is_absolute()
        or PureWindowsPath(text).is_absolute()
        or PureWindowsPath(text).drive
        or ".." in parts
    ):
        raise CheckpointIntegrityError(
            f"{what} {text!r} is not a relative path inside {str(root)!r}; checkpoints never "
            "read outside their folder (no absolute paths, no '..'). Pass a tag name that "
            "exists there, or restore the file that names it."
        )
    path = root / text
    base = root.resolve()
    target = path.resolve()
    if target != base and base not in target.parents:
        raise CheckpointIntegrityError(
            f"{what} {text!r} resolves to {str(target)!r}, outside {str(base)!r} (a symlink "
            "that leaves the checkpoint folder); refusing to read it. Copy the files into the "
            "checkpoint folder instead of linking them."
        )
    return path


def unreadable_file(path: Path, err: BaseException) -> CheckpointIntegrityError:
    """A rank file that cannot be opened as safetensors (corrupt header, truncated, missing)."""
    return CheckpointIntegrityError(
        f"cannot read checkpoint file {str(path)!r} ({type(err).__name__}: {err}); it is "
        "missing, truncated or corrupt. Restore it from a copy or load another tag."
    )


def read_tag_file(path: Path) -> str:
    """The tag named by a ``latest`` file, decoded strictly as UTF-8."""
    try:
        return path.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError as err:
        raise CheckpointIntegrityError(
            f"{str(path)!r} is not UTF-8 text ({err.reason} at byte {err.start}); it should "
            "hold one tag name. Rewrite it with the tag to load, delete it to load the newest "
            "finished tag, or pass tag= explicitly."
        ) from None


def check_file_names(tag_dir: Path, manifest: dict[str, Any]) -> None:
    """Every file the manifest names is a plain name inside ``tag_dir``."""
    names = [*manifest.get("files", []), *(manifest.get(CHECKSUMS) or {})]
    for item in manifest.get("index", {}).values():
        holders = [item, *item.get("tp", {}).get("shards", [])]  # tensor-parallel shards
        for holder in holders:
            for pieces in holder.get("kinds", {}).values():
                names.extend(piece[0] for piece in pieces)
    plain: set[str] = set()
    for name in names:
        if not isinstance(name, str) or "/" in name or "\\" in name:
            raise CheckpointIntegrityError(
                f"{str(tag_dir / 'manifest.json')!r} names file {name!r}, which is not a plain "
                "file name in the tag folder; the manifest is corrupt or was tampered with. "
                "Load another tag."
            )
        plain.add(name)
    for name in sorted(plain):  # a few distinct names (one or two per rank)
        inside(tag_dir, name, "manifest file entry")


# -- checksums ------------------------------------------------------------------------------
def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_sha256(data: dict[str, Any]) -> str:
    """sha256 of ``data`` as canonical JSON (sorted keys, no whitespace)."""
    return sha256_hex(json.dumps(data, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def seal(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with its own checksum added (last)."""
    return {**manifest, MANIFEST_SHA: canonical_sha256(manifest)}


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def check_seal(manifest: dict[str, Any], path: Path) -> bool:
    """Verify the manifest's own checksum; False (with a warning) for an old manifest
    without checksums."""
    sums, sealed = manifest.get(CHECKSUMS), manifest.get(MANIFEST_SHA)
    if sums is None and sealed is None:
        logger.warning(
            f"{path} has no checksums (saved before ShardSpeed recorded them); its files are "
            "loaded unverified. Save the checkpoint again to record checksums."
        )
        return False
    body = {k: v for k, v in manifest.items() if k != MANIFEST_SHA}
    if sums is None or not isinstance(sums, dict) or sealed != canonical_sha256(body):
        raise CheckpointIntegrityError(
            f"{path} does not match its own checksum ({MANIFEST_SHA}); the manifest is corrupt "
            "or was edited. Restore it from a copy or load another tag."
        )
    return True


def _problem(tag_dir: Path, name: str, expected: Any) -> str | None:
    path = tag_dir / name
    if not path.is_file():
        return f"{name}: missing"
    try:
        got = file_sha256(inside(tag_dir, name, "manifest file entry"))
    except OSError as err:
        return f"{name}: unreadable ({err})"
    return None if got == expected else f"{name}: sha256 {got[:12]}... != recorded {expected}"


def corruption_error(tag_dir: Path, problems: Iterable[str]) -> CheckpointIntegrityError:
    listed = "; ".join(problems)
    return CheckpointIntegrityError(
        f"checkpoint {str(tag_dir)!r} is corrupt: {listed}. The file changed after it was "
        "saved (disk or copy error, truncation, tampering). Restore it from a copy or load "
        "another tag; loading it unverified (verify_checksums=False) would read wrong "
        "values."
    )


def verify_files(
    tag_dir: Path, manifest: dict[str, Any], names: Iterable[str] | None = None
) -> None:
    """Check the sha256 of ``names`` (default: every recorded file); raise if any differ."""
    sums: dict[str, str] = manifest.get(CHECKSUMS) or {}
    chosen = sorted(sums) if names is None else list(names)
    problems = [p for n in chosen if (p := _problem(tag_dir, n, sums.get(n))) is not None]
    if problems:
        raise corruption_error(tag_dir, problems)


def verify_tag(tag_dir: Path, manifest: dict[str, Any]) -> None:
    """One process (e.g. ``to-fp32``): check every recorded file's checksum."""
    if CHECKSUMS in manifest:
        verify_files(tag_dir, manifest)


def verify_tag_distributed(
    tag_dir: Path, manifest: dict[str, Any], *, rank: int, world_size: int, group: Any
) -> None:
    """Every rank of a load: rank r hashes the files ``i % world_size == r`` and the ranks
    all-reduce which ones failed, so every rank raises the same error (none hangs)."""
    sums: dict[str, str] = manifest.get(CHECKSUMS) or {}
    if not sums:
        return  # an old checkpoint: load_manifest warned
    names = sorted(sums)
    flags = torch.zeros(len(names), dtype=torch.int32)
    mine: dict[str, str] = {}
    for i in range(rank, len(names), world_size):
        problem = _problem(tag_dir, names[i], sums[names[i]])
        if problem is not None:
            flags[i], mine[names[i]] = 1, problem
    if world_size > 1:
        dist.all_reduce(flags, group=group)
    bad = [names[i] for i in range(len(names)) if flags[i]]
    if bad:
        raise corruption_error(
            tag_dir,
            [mine.get(n, f"{n}: failed on rank {names.index(n) % world_size}") for n in bad],
        )

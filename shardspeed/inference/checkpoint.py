"""Load ``init_inference``'s ``checkpoint``: full tensors, sliced per rank as they are read.

``checkpoint`` may be a state-dict file (``.safetensors``, ``.bin``/``.pt``/``.pth``), a
directory (Hugging Face ``save_pretrained`` output: its ``*.safetensors`` or
``pytorch_model*.bin`` files), a JSON file (DeepSpeed's ``{"type": ..., "checkpoints":
[files], "base_dir": ...}`` descriptor, or a Hugging Face ``*.index.json`` with a
``weight_map``), or that descriptor as a dict. Files are read one at a time and each tensor
is copied into this rank's shard (:func:`~shardspeed.parallel.tensor.state.load_full_state_dict`),
so at most one file of full tensors is held at once. Every model tensor must be found
(tied ones count once) and no checkpoint tensor may be left over.

Files named by a JSON index or descriptor must lie inside its folder (or ``base_dir``): an
entry that is absolute or climbs out with ``..`` is refused, as are missing, unreadable or
corrupted files (each error names the file).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardspeed.parallel.tensor.state import load_full_state_dict

_STATE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def checkpoint_files(source: str | dict[str, Any], base_dir: str = "") -> list[Path]:
    """The state-dict files ``source`` names (see the module docstring)."""
    if isinstance(source, dict):
        return _from_descriptor(source, base_dir)
    path = Path(base_dir) / source if base_dir and not Path(source).is_absolute() else Path(source)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
        if not files:
            raise ValueError(
                f"init_inference: checkpoint directory {str(path)!r} has no *.safetensors or "
                "pytorch_model*.bin files; pass the state-dict file(s) instead."
            )
        return files
    if not path.exists():
        raise ValueError(f"init_inference: checkpoint {str(path)!r} does not exist.")
    if path.suffix == ".json":
        try:
            descriptor = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(
                f"init_inference: checkpoint descriptor {str(path)!r} is not readable JSON "
                f"({exc}); pass a Hugging Face *.index.json or DeepSpeed's checkpoint JSON."
            ) from exc
        if not isinstance(descriptor, dict):
            raise ValueError(
                f"init_inference: checkpoint descriptor {str(path)!r} holds a "
                f"{type(descriptor).__name__}, not a JSON object."
            )
        if "weight_map" in descriptor:  # Hugging Face sharded-checkpoint index
            weight_map = descriptor["weight_map"]
            if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) for f in weight_map.values()
            ):
                raise ValueError(
                    f"init_inference: {str(path)!r}: 'weight_map' must map tensor names to file "
                    "names."
                )
            return [_inside(path.parent, f, path) for f in sorted(set(weight_map.values()))]
        return _from_descriptor(descriptor, base_dir or str(path.parent))
    if path.suffix not in _STATE_SUFFIXES:
        raise ValueError(
            f"init_inference: checkpoint {str(path)!r}: unknown file type; use one of "
            f"{list(_STATE_SUFFIXES)}, a directory, or a JSON descriptor."
        )
    return [path]


def _from_descriptor(descriptor: dict[str, Any], base_dir: str) -> list[Path]:
    files = descriptor.get("checkpoints")
    if isinstance(files, str):
        files = [files]
    if not files or not isinstance(files, list):
        raise ValueError(
            f"init_inference: checkpoint descriptor {descriptor!r} needs 'checkpoints': a list of "
            "state-dict files (optionally with 'base_dir')."
        )
    if int(descriptor.get("tp_size", descriptor.get("mp_size", 1)) or 1) != 1:
        raise ValueError(
            "init_inference: pre-sharded (tp_size > 1) checkpoints are not supported; give the "
            "full state dict, it is sliced per rank at load."
        )
    if not all(isinstance(f, str) for f in files):
        raise ValueError(
            f"init_inference: checkpoint descriptor 'checkpoints' must hold file names, got "
            f"{files!r}."
        )
    root = Path(descriptor.get("base_dir") or base_dir or ".")
    return [_inside(root, f, "the checkpoint descriptor") for f in files]


def _inside(root: Path, name: str, where: object) -> Path:
    """``root / name``, refused when ``name`` is absolute or resolves outside ``root``."""
    candidate = Path(name)
    resolved_root = root.resolve()
    resolved = (root / candidate).resolve()
    if candidate.is_absolute() or not resolved.is_relative_to(resolved_root):
        raise ValueError(
            f"init_inference: {where} names checkpoint file {name!r}, which lies outside its "
            f"folder {str(root)!r}; list files relative to that folder (no absolute paths or "
            "'..')."
        )
    if not resolved.is_file():
        raise ValueError(
            f"init_inference: {where} names checkpoint file {name!r}, but {str(root / name)!r} "
            "does not exist; copy every file of the checkpoint into its folder."
        )
    return root / name


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """One file's tensors, on the CPU; ``ValueError`` naming the file if it is unreadable,
    truncated or not a name -> tensor mapping."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path), device="cpu")
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # safetensors, pickle and zip errors have no common base
        raise ValueError(
            f"init_inference: cannot read checkpoint file {str(path)!r} "
            f"({type(exc).__name__}: {exc}); the file is missing, truncated or corrupted."
        ) from exc
    if isinstance(state, dict) and "module" in state and isinstance(state["module"], dict):
        state = state["module"]  # a DeepSpeed model-states file
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise ValueError(
            f"init_inference: checkpoint file {str(path)!r} is not a state dict (a mapping of "
            "parameter names to tensors)."
        )
    return state


@torch.no_grad()
def load_checkpoint(model: nn.Module, source: str | dict[str, Any], base_dir: str = "") -> None:
    """Load every tensor of ``source`` into ``model`` (sharded or not), slicing per rank."""
    own = model.state_dict(keep_vars=True)
    loaded: set[int] = set()
    for path in checkpoint_files(source, base_dir):
        state = read_state_dict(path)
        unexpected = sorted(set(state) - set(own))
        if unexpected:
            raise ValueError(
                f"init_inference: checkpoint file {str(path)!r} holds tensors the model does not "
                f"have: {unexpected[:8]}; is it from the same model class?"
            )
        load_full_state_dict(model, state, strict=False)
        loaded.update(id(own[name]) for name in state)
        del state
    missing = sorted(name for name, t in own.items() if id(t) not in loaded)
    if missing:
        raise ValueError(
            f"init_inference: the checkpoint lacks model tensors {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}; pass every file of the checkpoint."
        )

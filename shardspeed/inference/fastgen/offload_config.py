"""The ``offload`` option of the FastGen engine (ZeRO-Inference), parsed once.

``EngineConfig.offload`` (and so ``pipeline(model, offload={...})``) takes a dict::

    {"device": "cpu" | "nvme" | "none",  # where the decoder layers' weights live
     "path": "/mnt/nvme/offload",         # nvme only: an existing writable directory
     "prefetch": 1,                       # layers fetched ahead of the running one (>= 0)
     "pin_memory": True,                  # CUDA: page-locked host buffers (async H2D)
     "budget_bytes": None}                # device-side bytes for weights + KV cache

``"none"`` (or ``offload=None``) keeps every weight on the compute device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

OFFLOAD_DEVICES = ("cpu", "nvme", "none")


@dataclass(frozen=True)
class OffloadConfig:
    """Where streamed decoder-layer weights live and how far ahead they are fetched.

    Attributes:
        device: ``"cpu"`` (a host copy, pinned on CUDA) or ``"nvme"`` (one file per
            layer under ``path``).
        path: directory for the ``nvme`` files (a private subdirectory is made in it
            and removed when the engine is garbage-collected); must be None for cpu.
        prefetch: how many layers are fetched ahead of the one computing; the device
            keeps ``prefetch + 1`` layer buffers (capped at the number of layers).
        pin_memory: on CUDA, keep host buffers page-locked so copies overlap compute.
        budget_bytes: device-side bytes for resident weights + layer buffers + KV
            cache; None => no check. When set and the engine's KV size is not given,
            the KV cache gets what the weights leave.
    """

    device: str = "cpu"
    path: str | None = None
    prefetch: int = 1
    pin_memory: bool = True
    budget_bytes: int | None = None

    @classmethod
    def parse(cls, value: Any) -> OffloadConfig | None:
        """An ``OffloadConfig`` from a dict (or one already built); None when disabled.

        Raises ``ValueError`` naming the bad key, its value, what is allowed and the fix.
        """
        if value is None or isinstance(value, OffloadConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"EngineConfig.offload={value!r} must be a dict like "
                '{"device": "cpu"} or {"device": "nvme", "path": "/some/dir"}, or None.'
            )
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ValueError(
                f"EngineConfig.offload has unknown key(s) {unknown}; allowed keys: {allowed}."
            )
        device = value.get("device", "cpu")
        if device not in OFFLOAD_DEVICES:
            raise ValueError(
                f"EngineConfig.offload['device']={device!r} is not supported; "
                f"choose one of {list(OFFLOAD_DEVICES)}."
            )
        if device == "none":
            return None
        value = dict(value)
        if isinstance(value.get("path"), os.PathLike):
            value["path"] = os.fspath(value["path"])
        config = cls(**value)
        config._check_numbers()
        config._check_path()
        return config

    def _check_numbers(self) -> None:
        p = self.prefetch
        if not isinstance(p, int) or isinstance(p, bool) or p < 0:
            raise ValueError(
                f"EngineConfig.offload['prefetch']={p!r} must be an int >= 0 "
                "(layers fetched ahead of the running one; 1 is a good default)."
            )
        if not isinstance(self.pin_memory, bool):
            raise ValueError(
                f"EngineConfig.offload['pin_memory']={self.pin_memory!r} must be True or False."
            )
        b = self.budget_bytes
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(
                f"EngineConfig.offload['budget_bytes']={b!r} must be a positive int (bytes) "
                "or None (no budget check)."
            )

    def _check_path(self) -> None:
        if self.device == "cpu":
            if self.path is not None:
                raise ValueError(
                    f"EngineConfig.offload['path']={self.path!r} is only used with "
                    "device='nvme'; drop 'path' or set 'device': 'nvme'."
                )
            return
        if self.path is None:
            raise ValueError(
                "EngineConfig.offload={'device': 'nvme'} needs 'path': an existing writable "
                "directory on the NVMe drive (per-layer weight files are written there)."
            )
        if not isinstance(self.path, (str, os.PathLike)):
            raise ValueError(
                f"EngineConfig.offload['path']={self.path!r} must be a directory path (str)."
            )
        path = Path(self.path)
        if not path.is_dir():
            raise ValueError(
                f"EngineConfig.offload['path']={str(path)!r} is not an existing directory; "
                "create it first or point 'path' at one."
            )
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(
                f"EngineConfig.offload['path']={str(path)!r} is not writable by this process; "
                "choose a directory you can write to."
            )

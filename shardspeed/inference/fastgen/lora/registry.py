"""The adapters an engine has loaded, by name, within ``max_loras`` / ``max_lora_rank``.

Loading reads and places the adapter outside the lock (file I/O can be slow) and
registers it under the lock, so the server can load and unload from its request
threads while the engine thread keeps stepping. A request resolves its adapter name
to the :class:`LoRAAdapter` object once, when it is added; unloading removes the name
only, so requests already running finish with the adapter they started with and its
tensors are freed when the last of them is gone.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

import torch

from shardspeed.inference.fastgen.lora.peft_format import read_peft_adapter
from shardspeed.inference.fastgen.lora.placement import LoRAWeights, place_adapter
from shardspeed.inference.fastgen.models import RaggedModel
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)


class LoRANotFoundError(ValueError):
    """A request or an unload named an adapter that is not loaded."""


@dataclass(eq=False)
class LoRAAdapter:
    """A loaded adapter: its weights per model projection (see :mod:`.placement`)."""

    name: str
    uid: int  # unique per load: a reloaded name never shares prefix-cache blocks
    path: str
    rank: int
    weights: dict[str, LoRAWeights] = field(repr=False)

    @property
    def cache_key(self) -> bytes:
        """What the prefix-cache hash chain of this adapter's requests starts from."""
        return f"lora:{self.uid}".encode()


class LoRARegistry:
    """Name -> :class:`LoRAAdapter` for one model, thread-safe."""

    def __init__(
        self,
        model: RaggedModel,
        max_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.dtype, self.device = dtype, device
        self._adapters: dict[str, LoRAAdapter] = {}
        self._lock = threading.RLock()
        self._uids = itertools.count(1)

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Read the PEFT adapter in directory ``path`` and serve it as ``name``."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"LoRA adapter name {name!r} must be a non-empty string.")
        self._check_room(name)
        peft = read_peft_adapter(path)
        if peft.rank > self.max_lora_rank:
            raise ValueError(
                f"LoRA adapter {name!r} ({path}) has rank {peft.rank} but the engine was "
                f"started with max_lora_rank={self.max_lora_rank}; raise "
                "EngineConfig.max_lora_rank (--max-lora-rank) or use a lower-rank adapter."
            )
        weights = place_adapter(self.model, peft, self.dtype, self.device)
        adapter = LoRAAdapter(name, next(self._uids), str(path), peft.rank, weights)
        with self._lock:
            self._check_room_locked(name)
            self._adapters[name] = adapter
        logger.info(
            "loaded LoRA adapter %r from %s (rank %d, %d modules)",
            name, path, peft.rank, len(peft.modules),
        )  # fmt: skip
        return adapter

    def unload(self, name: str) -> None:
        """Stop serving ``name``; requests already using it finish with it."""
        with self._lock:
            if name not in self._adapters:
                raise LoRANotFoundError(self._not_found(name))
            del self._adapters[name]
        logger.info("unloaded LoRA adapter %r", name)

    def get(self, name: str) -> LoRAAdapter:
        """The adapter loaded as ``name``; :class:`LoRANotFoundError` if none is."""
        with self._lock:
            adapter = self._adapters.get(name)
        if adapter is None:
            raise LoRANotFoundError(self._not_found(name))
        return adapter

    def names(self) -> list[str]:
        """Loaded adapter names, in load order."""
        with self._lock:
            return list(self._adapters)

    def _not_found(self, name: str) -> str:
        return (
            f"LoRA adapter {name!r} is not loaded; loaded adapters: {self.names()}. "
            "Load it first (POST /v1/load_lora_adapter or engine.lora.load)."
        )

    def _check_room(self, name: str) -> None:
        with self._lock:
            self._check_room_locked(name)

    def _check_room_locked(self, name: str) -> None:
        if name in self._adapters:
            raise ValueError(
                f"a LoRA adapter named {name!r} is already loaded; unload it first or pick "
                "another name."
            )
        if len(self._adapters) >= self.max_loras:
            raise ValueError(
                f"cannot load LoRA adapter {name!r}: max_loras={self.max_loras} adapters are "
                f"loaded ({list(self._adapters)}); unload one or raise EngineConfig.max_loras "
                "(--max-loras)."
            )

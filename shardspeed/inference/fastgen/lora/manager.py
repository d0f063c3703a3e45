"""One object the engine holds for multi-LoRA serving: the registry plus the hooks."""

from __future__ import annotations

from contextlib import AbstractContextManager

from shardspeed.inference.fastgen.lora.apply import LoRAHooks
from shardspeed.inference.fastgen.lora.registry import LoRAAdapter, LoRARegistry
from shardspeed.inference.fastgen.models import RaggedModel


class LoRAManager:
    """Loads / unloads adapters by name and applies them per batch (see the package docs).

    Safe to call :meth:`load`, :meth:`unload` and :meth:`names` from any thread;
    :meth:`resolve` and :meth:`scope` run on the engine's thread.
    """

    def __init__(self, model: RaggedModel, max_loras: int, max_lora_rank: int) -> None:
        param = next(model.parameters())
        self.registry = LoRARegistry(model, max_loras, max_lora_rank, param.dtype, param.device)
        self.hooks = LoRAHooks(model, param.device)

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Serve the PEFT adapter in directory ``path`` as ``name``."""
        return self.registry.load(name, path)

    def unload(self, name: str) -> None:
        """Stop accepting requests for ``name``; running ones finish with it."""
        self.registry.unload(name)

    def names(self) -> list[str]:
        """Loaded adapter names."""
        return self.registry.names()

    def resolve(self, name: str | None) -> LoRAAdapter | None:
        """The adapter a request named (None: the base model)."""
        return None if name is None else self.registry.get(name)

    def scope(self, batch: object) -> AbstractContextManager[None]:
        """Context in which the model's forwards apply ``batch``'s adapters."""
        return self.hooks.scope(batch)  # type: ignore[arg-type]


def resolve_lora(manager: LoRAManager | None, name: str | None) -> LoRAAdapter | None:
    """A request's adapter; ``ValueError`` when it names one on an engine without LoRA."""
    if name is None:
        return None
    if manager is None:
        raise ValueError(
            f"SamplingParams.lora_name={name!r} but the engine was started without LoRA; "
            "start it with enable_lora=True (--enable-lora) and load the adapter."
        )
    return manager.resolve(name)

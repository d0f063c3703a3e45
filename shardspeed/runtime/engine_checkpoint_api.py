"""DeepSpeed's checkpoint methods on the engine (``engine.save_checkpoint(...)`` etc.).

Thin entry points: the format, the resharding on load and the asynchronous writer live in
:mod:`shardspeed.checkpoint` (``engine_api.py``, ``model_export.py``), which read what
they need from the engine.
"""

from __future__ import annotations

from typing import Any


class CheckpointApiMixin:
    """Mixed into the engine; every method is a collective over the engine's ranks."""

    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        async_save: bool | None = None,
    ) -> bool:
        """Collective: every rank writes its own shards under ``save_dir/tag``.

        ``async_save`` (default: config ``checkpoint.async_save``) writes in the background.
        """
        from shardspeed.checkpoint.engine_api import save_checkpoint

        return save_checkpoint(
            self,
            save_dir,
            tag,
            client_state or {},
            save_latest,
            exclude_frozen_parameters,
            async_save=async_save,
        )

    def wait_checkpoint(self) -> None:
        """Wait for this rank's asynchronous save to be published; raise if it failed."""
        from shardspeed.checkpoint.engine_api import wait_checkpoint

        wait_checkpoint(self)

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load (and reshard to this layout) a checkpoint; returns ``(path, client_state)``."""
        from shardspeed.checkpoint.engine_api import load_checkpoint

        return load_checkpoint(
            self,
            load_dir,
            tag,
            load_module_strict,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
        )

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, Any]:
        """DeepSpeed's name (Accelerate's ZeRO-3 save): the full state dict as host tensors on
        rank 0 and {} elsewhere; a collective. With expert parallelism rank 0's dict holds
        every global expert (the ``ep_size=1`` model's names), as ``save_16bit_model``."""
        from shardspeed.checkpoint.model_export import export_state_dict

        state = export_state_dict(self, exclude_frozen_parameters)
        return state if state is not None else {}

    def save_16bit_model(
        self,
        save_dir: str,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Write the consolidated weights in the training dtype (rank 0 writes)."""
        from shardspeed.checkpoint.engine_api import save_16bit_model

        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    save_fp16_model = save_16bit_model

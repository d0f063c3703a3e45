"""DeepSpeed's read-only engine queries and its dataloader helper.

``was_step_applied``, ``get_global_grad_norm``, ``get_lr``, ``get_mom``, ``timers``,
``monitor``, ``memory_breakdown``, ``generate`` and ``deepspeed_io``: what DeepSpeed
users and trainers (Accelerate, the Hugging Face Trainer, Lightning) read off the engine.
None of them changes training state.
"""

from __future__ import annotations

from typing import Any

from shardspeed.runtime.memory import memory_breakdown


class EngineQueriesMixin:
    """Mixed into the engine; expects ``_config``, ``_last_step`` (the last
    ``StepResult`` or None), ``basic_optimizer``, ``reporter``, ``module`` and the data
    axis's ``dp_world_size``/``dp_rank``."""

    _config: Any
    _last_step: Any
    basic_optimizer: Any
    reporter: Any
    module: Any
    dp_world_size: int
    dp_rank: int

    def was_step_applied(self) -> bool:
        return self._last_step is not None and self._last_step.applied

    def get_global_grad_norm(self) -> float | None:
        return None if self._last_step is None else self._last_step.grad_norm

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.basic_optimizer.param_groups] if self.basic_optimizer else []

    def get_mom(self) -> list[Any]:
        if not self.basic_optimizer:
            return []
        return [g.get("betas", (g.get("momentum"),))[0] for g in self.basic_optimizer.param_groups]

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The model's ``generate`` (DeepSpeed passes it through to the module). With
        ``hybrid_engine.enabled`` ZeRO-3 weights are gathered once per call."""
        return self.module.generate(*args, **kwargs)

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held on this rank by category: params, grads, master_params, optimizer_state, buffers."""
        return memory_breakdown(self)

    @property
    def timers(self) -> Any:
        """Named phase timers (``forward``, ``backward``, ``backward_reduce``, ``step``)."""
        return self.reporter.timers

    @property
    def monitor(self) -> Any:
        return self.reporter.monitor

    def deepspeed_io(
        self,
        dataset: Any,
        batch_size: int | None = None,
        route: str = "train",
        pin_memory: bool = True,
        data_sampler: Any = None,
        collate_fn: Any = None,
        num_local_io_workers: int | None = None,
    ) -> Any:
        """A dataloader of micro-batches over this rank's share of ``dataset``."""
        from shardspeed.runtime.dataloader import ShardSpeedDataLoader

        return ShardSpeedDataLoader(
            dataset,
            batch_size or self._config.train_micro_batch_size_per_gpu,
            dp_world_size=self.dp_world_size,
            dp_rank=self.dp_rank,
            shuffle=route == "train",
            drop_last=self._config.dataloader_drop_last,
            collate_fn=collate_fn,
            num_workers=num_local_io_workers or 0,
            pin_memory=pin_memory,
            data_sampler=data_sampler,
        )

"""The hybrid engine (``hybrid_engine.enabled``): one engine that trains and generates.

RLHF loops (DeepSpeed-Chat's PPO) alternate a generation phase (the actor writes answers)
and a training phase on the same weights. :class:`HybridGeneration` is the generation side
of the training engine, a policy the engine holds when the block is enabled:

* ``engine.generate(...)`` and ``engine.module.generate(...)`` (the model's own
  ``generate``, patched as DeepSpeed does) run under ``torch.no_grad``;
* at ZeRO-3 with ``pin_parameters`` (the default) the sharded parameters are gathered
  *once* per generation phase, the per-unit gather hooks are paused while the model
  decodes token after token with its KV cache, and the gathered copies are released
  before training resumes. With ``pin_parameters: false`` the ordinary stage-3 hooks gather
  each unit around every decoding step instead (less memory, many more collectives);
* stages 0-2 hold whole parameters already: generation runs on them directly.

Generation never touches gradients, optimizer state or the reducer, so the losses of the
training steps that follow are exactly those of a run without generation
(``tests/dist/test_hybrid_engine.py``). Each call logs its gather and generate time (DEBUG) and adds them to
``gather_seconds`` / ``generate_seconds``.

Not here: DeepSpeed's fused inference kernels inside the hybrid engine (the model's own
forward runs) and ``inference_tp_size > 1`` (refused by the config).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from shardspeed.utils.logging import get_logger, log_dist

logger = get_logger(__name__)


class HybridGeneration:
    """Generation phases of a training engine (see the module docstring)."""

    def __init__(self, module: nn.Module, sharding: Any, pin_parameters: bool) -> None:
        original = getattr(module, "generate", None)
        if not callable(original):
            raise ValueError(
                f"hybrid_engine.enabled=true needs a model with a generate() method, but "
                f"{type(module).__name__} has none. Fix: give the model a generate() (Hugging "
                "Face models and shardspeed.models.GPT have one) or disable hybrid_engine."
            )
        self.module = module
        self._generate: Callable[..., Any] = original
        # stage 3 exposes the gather hooks; stages 0-2 have nothing to gather
        self.coordinator = getattr(sharding, "coordinator", None) if pin_parameters else None
        self.gather_seconds = 0.0
        self.generate_seconds = 0.0
        self.calls = 0
        module.generate = self.generate  # type: ignore[method-assign] # as DeepSpeed patches it

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The model's ``generate`` on gathered weights, without autograd."""
        start = time.perf_counter()
        with self._whole_model(), torch.no_grad():
            gathered = time.perf_counter()
            out = self._generate(*args, **kwargs)
        done = time.perf_counter()
        self.calls += 1
        self.gather_seconds += gathered - start
        self.generate_seconds += done - gathered
        log_dist(
            f"hybrid engine generate #{self.calls}: gather {1e3 * (gathered - start):.1f} ms, "
            f"generate {1e3 * (done - gathered):.1f} ms",
            level=logging.DEBUG,
        )
        return out

    @contextlib.contextmanager
    def _whole_model(self) -> Iterator[None]:
        """Stage 3 with pinned parameters: gather every unit once, pause the per-unit
        hooks while generating, release on the way out (a collective over the data axis)."""
        if self.coordinator is None:
            yield
            return
        from shardspeed.zero.init import GatheredParameters

        self.coordinator.paused = True
        try:
            with GatheredParameters(list(self.module.parameters())):
                yield
        finally:
            self.coordinator.paused = False

    def remove(self) -> None:
        """Give the model its own ``generate`` back."""
        if self.module.__dict__.get("generate") == self.generate:
            del self.module.generate

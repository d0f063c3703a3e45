"""``shardspeed.pipe``: pipeline parallelism with DeepSpeed's ``deepspeed.pipe`` API.

>>> from shardspeed.pipe import PipelineModule, LayerSpec
>>> net = PipelineModule([LayerSpec(torch.nn.Linear, 8, 8) for _ in range(4)], num_stages=2,
...                      loss_fn=torch.nn.functional.mse_loss)            # doctest: +SKIP
>>> engine, *_ = shardspeed.initialize(model=net, config=ds_config)       # doctest: +SKIP
>>> loss = engine.train_batch(data_iter)                                  # doctest: +SKIP

See ``docs/pipeline.md``.
"""

from __future__ import annotations

from typing import Any

from shardspeed.parallel.pipeline.layers import LayerSpec, TiedLayerSpec
from shardspeed.parallel.pipeline.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)
from shardspeed.runtime.pipe.module import PipelineModule


def __getattr__(name: str) -> Any:
    # The engine imports the whole training runtime; load it only when asked for.
    if name in ("PipelineEngine", "PipelineError"):
        from shardspeed.runtime.pipe import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'shardspeed.pipe' has no attribute {name!r}")


__all__ = [
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineEngine",
    "PipelineError",
    "PipelineModule",
    "ProcessTopology",
    "TiedLayerSpec",
]

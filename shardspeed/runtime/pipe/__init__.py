"""The pipeline runtime (DeepSpeed's ``deepspeed.runtime.pipe``).

* :mod:`.module`: ``PipelineModule``, a layer list cut into stages;
* :mod:`.executor`: runs one stage's instruction stream;
* :mod:`.engine`: ``PipelineEngine``, the sharding engine over one stage;
* :mod:`.schedule`, :mod:`.topology`: DeepSpeed's import paths for the schedules and the
  topology classes.

The building blocks they run (schedules, partitioning, p2p, tied weights, topology
classes) live in :mod:`shardspeed.parallel.pipeline`; the public entry point is
:mod:`shardspeed.pipe`. Submodules load on first attribute access.
"""

from __future__ import annotations

from types import ModuleType

from shardspeed._submodules import load_submodule
from shardspeed.parallel.pipeline.layers import LayerSpec, TiedLayerSpec
from shardspeed.parallel.pipeline.topology import ProcessTopology
from shardspeed.runtime.pipe.module import PipelineModule


def __getattr__(name: str) -> ModuleType:
    return load_submodule(__name__, name)


__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]

"""The pipeline runtime (DeepSpeed's ``deepspeed.runtime.pipe``).

* :mod:`.module`: ``PipelineModule``, a layer list cut into stages;
* :mod:`.executor`: runs one stage's instruction stream;
* :mod:`.engine`: ``PipelineEngine``, the sharding engine over one stage.

The building blocks they run (schedules, partitioning, p2p, tied weights, topology
classes) live in :mod:`shardspeed.parallel.pipeline`; the public entry point is
:mod:`shardspeed.pipe`.
"""

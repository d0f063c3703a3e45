"""Pipeline-parallel building blocks: schedules as data, stage partitioning, p2p.

* :mod:`.instructions` / :mod:`.schedule`: the instruction set and pure schedule builders
  (GPipe, 1F1B, interleaved 1F1B, inference); :mod:`.simulate` runs them on a virtual clock.
* :mod:`.layers` / :mod:`.partition`: ``LayerSpec`` and partition methods;
  :mod:`.topology`: DeepSpeed's topology classes.
* :mod:`.p2p` / :mod:`.tied`: stage-to-stage sends and tied-weight groups.

``PipelineModule``, the schedule executor and ``PipelineEngine`` are the runtime and live
in :mod:`shardspeed.runtime.pipe`. The public entry point is :mod:`shardspeed.pipe`.
"""

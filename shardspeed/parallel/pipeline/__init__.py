"""Pipeline parallelism: schedules as data, stage partitioning, p2p and the engine.

* :mod:`.instructions` / :mod:`.schedule`: the instruction set and pure schedule builders
  (GPipe, 1F1B, interleaved 1F1B, inference); :mod:`.simulate` runs them on a virtual clock.
* :mod:`.layers` / :mod:`.partition` / :mod:`.module`: ``LayerSpec``, partition methods,
  ``PipelineModule``; :mod:`.topology`: DeepSpeed's topology classes.
* :mod:`.p2p` / :mod:`.executor` / :mod:`.tied` / :mod:`.optimizer` / :mod:`.engine`: the runtime.

The public entry point is :mod:`shardspeed.pipe`.
"""

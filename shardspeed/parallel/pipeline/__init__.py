"""Pipeline-parallel building blocks: schedules as data, stage partitioning, p2p.

* :mod:`.instructions` / :mod:`.schedule`: the instruction set and pure schedule builders
  (GPipe, 1F1B, interleaved 1F1B, the zero-bubble ZB-H1 / ZBV / DualPipeV, inference);
  :mod:`.simulate` runs them on a virtual clock (bubble, activation memory).
* :mod:`.weight_grad`: the B/W split (deferred ``nn.Linear`` weight gradients) that the
  zero-bubble schedules run.
* :mod:`.layers` / :mod:`.partition`: ``LayerSpec`` and partition methods;
  :mod:`.topology`: DeepSpeed's topology classes.
* :mod:`.p2p` / :mod:`.tied`: stage-to-stage sends and tied-weight groups.

``PipelineModule``, the schedule executor and ``PipelineEngine`` are the runtime and live
in :mod:`shardspeed.runtime.pipe`. The public entry point is :mod:`shardspeed.pipe`.
"""

"""Model-parallel building blocks (pipeline schedules, partitioning and p2p live in
``pipeline/``; the pipeline runtime is ``shardspeed.runtime.pipe``; the public API is
``shardspeed.pipe``)."""

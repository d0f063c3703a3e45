"""Model-parallel building blocks (pipeline parallelism lives in ``pipeline/``; its public
API is ``shardspeed.pipe``)."""

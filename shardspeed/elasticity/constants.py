"""Key names, defaults and fixed values of the ``"elasticity"`` ds_config block.

The names are DeepSpeed's (``deepspeed.elasticity.constants`` up to 0.19.6), so code that
reads a config with them keeps working. An enabled block looks like::

    "elasticity": {
        "enabled": true,
        "max_train_batch_size": 1024,     # the global batch is at most this
        "micro_batch_sizes": [2, 4, 8],   # per-rank batches the model fits
        "min_gpus": 1,
        "max_gpus": 64,                   # search range of data-parallel sizes
        "prefer_larger_batch": true,      # tie-break between equally elastic batches
        "version": 0.2                    # 0.2 works per node (num_gpus_per_node)
    }
"""

from __future__ import annotations

FORMAT = """
An enabled elasticity block names at least the batch cap and the micro batches:
"elasticity": {
  "enabled": true,
  "max_train_batch_size": 1024,
  "micro_batch_sizes": [2, 4, 8],
  "min_gpus": 1,
  "max_gpus": 64,
  "min_time": 0,
  "prefer_larger_batch": true,
  "ignore_non_elastic_batch_info": false,
  "version": 0.2
}
"""
"""An example block, for messages and documentation."""

ELASTICITY = "elasticity"
"""The top-level ds_config key of the block."""

LATEST_ELASTICITY_VERSION = 0.2
"""The newest algorithm version (0.1: per GPU; 0.2: per node, with model parallelism)."""

ENABLED = "enabled"
ENABLED_DEFAULT = False

MAX_ACCEPTABLE_BATCH_SIZE = "max_train_batch_size"
MAX_ACCEPTABLE_BATCH_SIZE_DEFAULT = 2000

MICRO_BATCHES = "micro_batch_sizes"
MICRO_BATCHES_DEFAULT = [2, 4, 6]

MIN_GPUS = "min_gpus"
MIN_GPUS_DEFAULT = 1
MAX_GPUS = "max_gpus"
MAX_GPUS_DEFAULT = 10000

NUM_GPUS_PER_NODE = "num_gpus_per_node"
NUM_GPUS_PER_NODE_DEFAULT = 1

MODEL_PARALLEL_SIZE = "model_parallel_size"
MODEL_PARALLEL_SIZE_DEFAULT = 1

MIN_TIME = "min_time"
"""Minutes a resource scheduler should let the job run before rescaling (0: unknown)."""
MIN_TIME_DEFAULT = 0

PREFER_LARGER_BATCH = "prefer_larger_batch"
"""Between batch sizes that allow equally many GPU counts, take the larger one."""
PREFER_LARGER_BATCH_DEFAULT = True

IGNORE_NON_ELASTIC_BATCH_INFO = "ignore_non_elastic_batch_info"
"""When false, batch keys beside an enabled block are an error; when true they are ignored."""
IGNORE_NON_ELASTIC_BATCH_INFO_DEFAULT = False

VERSION = "version"
VERSION_DEFAULT = LATEST_ELASTICITY_VERSION

MINIMUM_DEEPSPEED_VERSION = "0.3.8"
"""The oldest DeepSpeed release with elasticity (checked against ``target_deepspeed_version``)."""

DEEPSPEED_ELASTICITY_CONFIG = "DEEPSPEED_ELASTICITY_CONFIG"
"""Environment variable holding the elasticity block a resource scheduler planned with."""

COMPATIBLE_DEEPSPEED_VERSION = "0.19.6"
"""The DeepSpeed release whose elasticity this package reproduces (the last one that had
it); ShardSpeed's runtime passes it as ``target_deepspeed_version``."""

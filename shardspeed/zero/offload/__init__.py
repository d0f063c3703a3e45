"""ZeRO-Offload and ZeRO-Infinity: optimizer state and parameters off the accelerator.

* ``offload_optimizer.device: cpu`` (stages 1-3): fp32 masters and optimizer state in
  (pinned) host memory; gradient shards are copied device -> host for the step, the
  torch optimizer (fused CPU kernel) runs on the host, updated values go back to the
  device parameter shard.
* ``offload_param.device: cpu`` (stage 3): each unit's parameter shard in host memory,
  copied to the device before its all-gather.
* ``device: nvme`` (stage 3): the same state in swap files under ``nvme_path``, moved
  through a bounded pool of host buffers by a small I/O thread pool (see
  :mod:`~shardspeed.zero.offload.optimizer_swapper` and
  :mod:`~shardspeed.zero.offload.param_swapper`).

See ``docs/offload.md``.
"""

from shardspeed.zero.offload.host import host_zeros
from shardspeed.zero.offload.policy import OffloadPolicy, SwapSettings
from shardspeed.zero.offload.runtime import OffloadRuntime

__all__ = ["OffloadPolicy", "OffloadRuntime", "SwapSettings", "host_zeros"]

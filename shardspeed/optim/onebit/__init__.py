"""Communication-compressed optimizers: 1-bit Adam, 0/1 Adam and 1-bit LAMB.

DeepSpeed's ``OneBitAdam`` / ``ZeroOneAdam`` / ``OneBitLamb`` (removed from DeepSpeed in
0.19.7), on any ``torch.distributed`` backend. Each averages gradients itself
(``reduces_gradients = True``): full precision during warm-up, then momentum (or gradients)
compressed to one sign bit per element plus one scale per chunk, with error feedback on
both the worker and the server side (:mod:`~shardspeed.optim.onebit.compressor`,
:mod:`~shardspeed.optim.onebit.compressed_allreduce`). See ``docs/onebit.md``.
"""

from __future__ import annotations

from shardspeed.optim.onebit.adam import OnebitAdam
from shardspeed.optim.onebit.compressed_allreduce import CompressedAllReduce, ErrorFeedback
from shardspeed.optim.onebit.lamb import OnebitLamb
from shardspeed.optim.onebit.zoadam import ZeroOneAdam

__all__ = ["CompressedAllReduce", "ErrorFeedback", "OnebitAdam", "OnebitLamb", "ZeroOneAdam"]

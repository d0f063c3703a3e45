"""FastGen tensor parallelism: one engine's model sharded over this process and spawned workers.

``InferenceEngine(model, config=EngineConfig(tensor_parallel=T))`` (or
``pipeline(model, tensor_parallel=T)``) builds rank 0's shard here and ``T - 1``
worker processes for the others; the shard layout is in
:mod:`shardspeed.inference.fastgen.models.tp_shard`, the process model in
:mod:`.peers`, the worker loop in :mod:`.worker`.
"""

from shardspeed.inference.fastgen.tensor_parallel.errors import TensorParallelError
from shardspeed.inference.fastgen.tensor_parallel.peers import TensorParallelPeers
from shardspeed.inference.fastgen.tensor_parallel.start import start_tensor_parallel

__all__ = ["TensorParallelError", "TensorParallelPeers", "start_tensor_parallel"]

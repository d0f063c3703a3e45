"""Tensor parallelism: Megatron-style layers and AutoTP sharding of Hugging Face models.

* :mod:`~.partition`: pure shard math (DeepSpeed AutoTP widths, fused sub-parameters).
* :mod:`~.groups`: the tensor-axis process group, from one cached ``Topology`` per tp size.
* :mod:`~.comm_ops`: autograd copy/reduce/scatter/gather over the tensor axis and their
  sequence-parallel (token-dim) variants.
* :mod:`~.layers`: ``ColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding``.
* :mod:`~.cross_entropy`: vocabulary-parallel cross-entropy (no full logits on any rank).
* :mod:`~.policies`, :mod:`~.autotp`: which layers split how; ``tp_model_init``.
* :mod:`~.state`: gather full tensors / load full tensors by slicing.

See docs/tensor_parallel.md.
"""

from __future__ import annotations

from shardspeed.parallel.tensor.autotp import TensorParallelPlan, shard_model, tp_model_init
from shardspeed.parallel.tensor.cross_entropy import (
    VocabParallelCausalLMLoss,
    vocab_parallel_cross_entropy,
)
from shardspeed.parallel.tensor.groups import register_topology, tensor_group, topology_for
from shardspeed.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from shardspeed.parallel.tensor.partition import ShardLayout
from shardspeed.parallel.tensor.policies import TPPolicy, policy_for
from shardspeed.parallel.tensor.state import gather_full_state_dict, load_full_state_dict

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ShardLayout",
    "TPPolicy",
    "TensorParallelPlan",
    "VocabParallelCausalLMLoss",
    "VocabParallelEmbedding",
    "gather_full_state_dict",
    "load_full_state_dict",
    "policy_for",
    "register_topology",
    "shard_model",
    "tensor_group",
    "topology_for",
    "tp_model_init",
    "vocab_parallel_cross_entropy",
]

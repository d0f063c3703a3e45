"""Mixture of Experts with expert parallelism (public as :mod:`shardspeed.moe`).

* :mod:`~shardspeed.parallel.moe.gating`: ``TopKGate``, top-1 / top-2 / top-k routing,
  capacity, RTS, noisy gates, the load-balancing loss.
* :mod:`~shardspeed.parallel.moe.dispatch`: all-to-all dispatch and combine over the
  expert group (padded buffers when dropping, uneven splits when not).
* :mod:`~shardspeed.parallel.moe.experts`: the local experts, marked for the engine.
* :mod:`~shardspeed.parallel.moe.layer`: ``MoE`` and ``MOELayer``.
* :mod:`~shardspeed.parallel.moe.groups`: one ``Topology`` per ``ep_size``.
* :mod:`~shardspeed.parallel.moe.utils`: ``is_moe_param``, optimizer param groups.
* :mod:`~shardspeed.parallel.moe.ds_format`: DeepSpeed's gate output tuples.
"""

from __future__ import annotations

from shardspeed.parallel.moe.experts import Experts
from shardspeed.parallel.moe.gating import Routing, TopKGate
from shardspeed.parallel.moe.groups import expert_data_group_of, topology_for
from shardspeed.parallel.moe.layer import MoE, MOELayer
from shardspeed.parallel.moe.utils import (
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
)

__all__ = [
    "Experts",
    "MOELayer",
    "MoE",
    "Routing",
    "TopKGate",
    "expert_data_group_of",
    "is_moe_param",
    "split_params_into_different_moe_groups_for_optimizer",
    "topology_for",
]

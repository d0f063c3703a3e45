"""The engine's whole-model state: ``state_dict``/``load_state_dict`` and master refresh.

Who holds which elements of a parameter decides how a full state dict is built or taken
apart, so that is a policy chosen once (:func:`build_state_dict_policy`):

* the sharding layout itself (:class:`~shardspeed.zero.sharding.FlatSharding`: the
  module's own dict; :class:`~shardspeed.zero.unit_sharding.UnitSharding`: gathered over
  the data axis around the call);
* :class:`TensorParallelState` with tensor parallelism: ZeRO-3 shards gathered over the
  data axis, then each tensor-parallel slice gathered (or taken) over the tensor axis.

After a load the masters must follow the loaded parameters; whether the layout already
does that (stage 3: the gathered units write back into shards and masters on exit) is the
layout's ``load_updates_masters``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn

from shardspeed.topology import Topology
from shardspeed.zero.fragments import param_fragments


class TensorParallelState:
    """Full state dicts of a tensor-parallel module (a collective over data and tensor)."""

    def full_state_dict(self, module: nn.Module, *args: Any, **kwargs: Any) -> dict[str, Any]:
        from shardspeed.parallel.tensor.state import gather_full_state_dict
        from shardspeed.zero.init import GatheredParameters

        with GatheredParameters(list(module.parameters())):  # ZeRO-3: data axis
            return gather_full_state_dict(module)  # then the tensor axis

    def load_full_state_dict(self, module: nn.Module, state_dict: Any, strict: bool) -> Any:
        from shardspeed.parallel.tensor.state import load_full_state_dict
        from shardspeed.zero.init import GatheredParameters

        with GatheredParameters(list(module.parameters()), modifier_rank=0):
            return load_full_state_dict(module, state_dict, strict=strict)


def build_state_dict_policy(topology: Topology, sharding: Any) -> Any:
    """:class:`TensorParallelState` on a tensor-parallel mesh, else the sharding layout."""
    return TensorParallelState() if topology.size("tensor") > 1 else sharding


class EngineStateMixin:
    """Mixed into the engine; expects ``module``, ``sharding``, ``state_dict_policy``,
    ``flat_groups`` and ``optimizer`` (a ``ShardedOptimizer`` or None)."""

    module: nn.Module
    sharding: Any
    state_dict_policy: Any
    flat_groups: list[Any]
    optimizer: Any

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The module's full state dict in its own names and layout (a collective call at
        stage 3 and with tensor parallelism: shards are gathered)."""
        return self.state_dict_policy.full_state_dict(self.module, *args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a full state dict (every rank passes the same one; at stage 3 the shards and
        masters are updated too; with tensor parallelism each rank takes its slices; with
        expert parallelism each rank takes its experts from the ``ep_size=1`` model's dict
        that ``save_16bit_model`` writes, or a dict in its own local names as is)."""
        from shardspeed.checkpoint.expert_placement import ExpertNames

        state_dict = ExpertNames.of(self.module).local_state(state_dict)
        result = self.state_dict_policy.load_full_state_dict(self.module, state_dict, strict)
        if not self.sharding.load_updates_masters:
            self._masters_from_params()
        return result

    @torch.no_grad()
    def _masters_from_params(self) -> None:
        """Copy the (just loaded) whole parameters into this rank's master fragments, so the
        next step starts from them instead of the stale masters (bf16/fp16, offload)."""
        resident = (
            self.optimizer.state_resident(write=True)
            if self.optimizer is not None
            else contextlib.nullcontext()
        )
        with resident:
            for group in self.flat_groups:
                if getattr(group, "masters_alias_params", False):
                    continue
                for f in param_fragments(group):
                    master = group.masters[f.master_index].view(-1)[f.local : f.local + f.length]
                    master.copy_(f.param.detach().reshape(-1)[f.start : f.start + f.length])

    @torch.no_grad()
    def publish_params(self) -> None:
        """Masters -> parameter shards -> usable parameters (after a checkpoint load)."""
        if self.optimizer is not None:
            self.optimizer._publish_params()  # respects NVMe-swapped masters
            return
        for group in self.flat_groups:
            group.copy_masters_to_params()
        self.sharding.publish()

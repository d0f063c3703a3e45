"""MoE experts in a checkpoint: stored under global expert ids, mapped to local ones on load.

An expert-parallel MoE layer holds ``num_local_experts`` experts per rank under the same
local names on every expert-parallel rank (``...deepspeed_experts.<local id>.*``). A
checkpoint stores each expert under its *global* id instead::

    global id = ep_rank * num_local_experts + local id

    ep 2, 4 experts:  ep rank 0 holds global 0, 1 (local 0, 1)
                      ep rank 1 holds global 2, 3 (local 0, 1)

so the stored names are those of an ``ep_size=1`` model holding every expert (what
``get_fp32_state_dict_from_checkpoint`` returns). Every other part of the format is
unchanged: an expert's masters and optimizer state are fragments by name and offset,
so a rank at another ep (or another ``expert_data`` sharding, or ZeRO stage) reads the
global experts it holds now and refills its own fragments of them.

Experts are replicated over their ``expert_data`` axis: at stage 0 (and wherever a
fragment is not sharded) only ``expert_data`` rank 0 of each expert-parallel rank writes
them, as DeepSpeed's ``expert_*`` files are written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

EXPERTS_ATTR = "deepspeed_experts"  # the ModuleList of an MoE layer's local experts


@dataclass(frozen=True)
class ExpertBlock:
    """One MoE layer's local experts on this rank: names ``<prefix><local id>.<rest>``."""

    prefix: str  # e.g. "moe.deepspeed_moe.experts.deepspeed_experts."
    num_local_experts: int
    ep_size: int
    ep_rank: int  # this rank's coordinate on the layer's ``expert`` axis
    expert_data_rank: int  # this rank's coordinate on the layer's ``expert_data`` axis

    def split(self, name: str) -> tuple[int, str] | None:
        """``(local id, rest)`` of ``name`` if it lies in this block, else None."""
        if not name.startswith(self.prefix):
            return None
        local, _, rest = name[len(self.prefix) :].partition(".")
        if not local.isdigit() or not rest:
            return None
        return int(local), rest

    def global_id(self, local_id: int) -> int:
        if not 0 <= local_id < self.num_local_experts:
            raise ValueError(
                f"expert parameter {self.prefix}{local_id}.* has local id {local_id}, outside "
                f"the layer's num_local_experts={self.num_local_experts}; the model does not "
                "match its MoE layer's expert count."
            )
        return self.ep_rank * self.num_local_experts + local_id


class ExpertNames:
    """Maps a model's local parameter/buffer names to checkpoint (global-expert) names.

    Built from the model's :class:`~shardspeed.parallel.moe.experts.Experts` modules; a
    model without expert-parallel layers (ep_size 1) maps every name to itself.
    """

    def __init__(self, blocks: list[ExpertBlock]) -> None:
        self.blocks = blocks

    @classmethod
    def of(cls, module: nn.Module) -> ExpertNames:
        """The expert blocks of ``module`` (queries the ep topology of each layer)."""
        from shardspeed.parallel.moe.experts import Experts

        blocks = []
        for name, sub in module.named_modules():
            if not isinstance(sub, Experts):
                continue
            prefix = f"{name}.{EXPERTS_ATTR}." if name else f"{EXPERTS_ATTR}."
            ep_size, ep_rank, ed_rank = _expert_coordinates(sub)
            if ep_size == 1:
                continue  # every expert under its own (global) name already
            blocks.append(ExpertBlock(prefix, sub.num_local_experts, ep_size, ep_rank, ed_rank))
        return cls(blocks)

    def block_of(self, name: str) -> tuple[ExpertBlock, int, str] | None:
        for block in self.blocks:
            found = block.split(name)
            if found is not None:
                return block, found[0], found[1]
        return None

    def is_expert(self, name: str) -> bool:
        return self.block_of(name) is not None

    def global_name(self, name: str) -> str:
        """``name`` with its local expert id replaced by the global one (others unchanged)."""
        found = self.block_of(name)
        if found is None:
            return name
        block, local, rest = found
        return f"{block.prefix}{block.global_id(local)}.{rest}"

    def writes_replica(self, name: str, dp_rank: int) -> bool:
        """Whether this rank writes ``name`` where every replica holds it whole (stage 0
        masters, frozen parameters, buffers): ``expert_data`` rank 0 for an expert's,
        data rank 0 for a dense one's."""
        found = self.block_of(name)
        if found is None:
            return dp_rank == 0
        return found[0].expert_data_rank == 0

    def global_order(self, names: list[str]) -> list[str]:
        """``names`` (a rank's state-dict keys) with each expert block expanded to every
        global expert, in global id order, where the block's first key stood."""
        out: list[str] = []
        done: set[str] = set()
        for name in names:
            found = self.block_of(name)
            if found is None:
                out.append(name)
                continue
            block = found[0]
            if block.prefix in done:
                continue
            done.add(block.prefix)
            rests = [part[1] for n in names if (part := block.split(n)) and part[0] == 0]
            num_experts = block.ep_size * block.num_local_experts
            out.extend(f"{block.prefix}{g}.{rest}" for g in range(num_experts) for rest in rests)
        return out

    def local_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` in this rank's local names, for ``module.load_state_dict``.

        A state dict of the ``ep_size=1`` model (global expert ids, as ``save_16bit_model``
        writes and checkpoints consolidate to) keeps this rank's experts, renamed to local
        ids, and drops the other ranks'; one already in local names (no expert id beyond
        ``num_local_experts``, e.g. this rank's own ``module.state_dict()``) is unchanged.
        """
        out = dict(state)
        for block in self.blocks:
            ids = {found[0] for key in state if (found := block.split(key)) is not None}
            if not ids or max(ids) < block.num_local_experts:
                continue  # local names already (or no experts of this layer at all)
            num_experts = block.ep_size * block.num_local_experts
            if max(ids) >= num_experts:
                raise ValueError(
                    f"state dict entry {block.prefix}{max(ids)}.* names expert {max(ids)}, but "
                    f"the layer has {num_experts} experts (ids 0..{num_experts - 1}); the state "
                    "dict is of another model."
                )
            base = block.ep_rank * block.num_local_experts
            for key in state:
                found = block.split(key)
                if found is None:
                    continue
                del out[key]
                global_id, rest = found
                if base <= global_id < base + block.num_local_experts:
                    out[f"{block.prefix}{global_id - base}.{rest}"] = state[key]
        return out


def _expert_coordinates(experts: nn.Module) -> tuple[int, int, int]:
    """``(ep_size, ep rank, expert_data rank)`` of an Experts module's layer (ep 1 without
    expert parallelism)."""
    group_name = next((getattr(p, "group_name", None) for p in experts.parameters()), None)
    if group_name is None:
        return 1, 0, 0
    from shardspeed.parallel.moe.groups import ep_size_of, topology_for

    ep_size = ep_size_of(group_name)
    if ep_size == 1:
        return 1, 0, 0
    topology = topology_for(ep_size)
    return ep_size, topology.rank_in("expert"), topology.rank_in("expert_data")

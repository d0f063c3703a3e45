"""DeepSpeed's ``deepspeed.runtime.pipe.topology``: the process-grid classes, re-exported
from :mod:`shardspeed.parallel.pipeline.topology`, and ``PipelineParallelGrid``.

``PipelineParallelGrid`` is DeepSpeed's ``mpu`` for pipeline jobs: the ranks and process
groups of one :class:`ProcessTopology` (axes ``pipe, data[, model]``). Here it is a face over
:class:`shardspeed.topology.Topology`, which owns the groups; DeepSpeed's names map onto
its axes::

    DeepSpeed            Topology axis   (world 8, pp=2 dp=2 mp=2: rank 5's group)
    pipe                 pipe            [1, 5]
    data                 data            [5, 7]
    slice (model axis)   tensor          [4, 5]
    model (pipe x model) model           [0, 1, 4, 5]   (every rank of one data replica)
"""

from __future__ import annotations

from typing import Any

from shardspeed import comm
from shardspeed.parallel.pipeline.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)
from shardspeed.topology import Topology
from shardspeed.utils.logging import log_dist


def _prime_factors(n: int) -> list[int]:
    """Prime factors of ``n``, ascending, with repetition."""
    factors, p = [], 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors


def _default_topology(world_size: int) -> ProcessTopology:
    """DeepSpeed's default grid: prime factors of the world dealt alternately to pipe, data."""
    num_pp = num_dp = 1
    for i, prime in enumerate(_prime_factors(world_size)):
        if i % 2 == 0:
            num_pp *= prime
        else:
            num_dp *= prime
    return PipeDataParallelTopology(num_pp=num_pp, num_dp=num_dp)


class PipelineParallelGrid:
    """Ranks and process groups of a pipeline (x data x model) grid, DeepSpeed's ``mpu``.

    Collective to build (every rank, same ``topology``): it creates the groups of the
    equivalent :class:`Topology`. ``topology`` is a :class:`ProcessTopology` (default:
    DeepSpeed's prime-factor split of the world into pipe x data) or a ``Topology``.
    ``process_group`` is accepted for DeepSpeed compatibility; the grid spans the world.
    """

    def __init__(
        self, topology: ProcessTopology | Topology | None = None, process_group: Any = None
    ):
        del process_group  # DeepSpeed ignores it too
        self.global_rank = comm.get_rank()
        self.world_size = comm.get_world_size()
        if isinstance(topology, Topology):
            self.topo = topology
            self._topo = PipeModelDataParallelTopology(topology.pp, topology.tp, topology.dp)
        else:
            self._topo = topology if topology is not None else _default_topology(self.world_size)
            if self._topo.world_size() != self.world_size:
                raise ValueError(
                    f"PipelineParallelGrid(topology={self._topo!r}) covers "
                    f"{self._topo.world_size()} ranks but the world has {self.world_size}; "
                    "pass a topology whose dims multiply to the world size."
                )
            self.topo = self._topo.to_topology()
            log_dist(f"Using topology: {self._topo}", ranks=[0])
        try:
            self.topo.group("world")
        except RuntimeError:  # no groups yet: build them (collective)
            self.topo.create_groups()
        coords = self.topo.coords(self.global_rank)
        self.data_parallel_size = self.topo.dp
        self.pipe_parallel_size = self.topo.pp
        self.model_parallel_size = self.topo.tp
        self.slice_parallel_size = self.model_parallel_size
        self.stage_id = coords.pipe
        self.data_parallel_id = coords.data
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        self.dp_group = self.topo.axis_ranks("data")
        self.dp_groups = self._topo.get_axis_comm_lists("data")
        self.dp_proc_group = self.topo.group("data")
        self.pp_group = self.topo.axis_ranks("pipe")
        self.pipe_groups = self._topo.get_axis_comm_lists("pipe")
        self.pp_proc_group = self.topo.group("pipe")
        self.slice_group = self.topo.axis_ranks("tensor")
        self.slice_proc_group = self.topo.group("tensor")
        model_ranks = self.topo.axis_ranks("model")  # pipe x model: one data replica
        self.ds_model_proc_group = self.topo.group("model")
        self.ds_model_world_size = len(model_ranks)
        self.ds_model_rank = model_ranks.index(self.global_rank)
        self.p2p_groups = self._build_p2p_groups()

    def _build_p2p_groups(self) -> list[list[int]]:
        """``[rank, next stage's rank]`` for every rank (the last stage wraps to the first)."""
        pairs = []
        for rank in range(self.world_size):
            stages = self.topo.axis_ranks("pipe", rank)
            pairs.append([rank, stages[(stages.index(rank) + 1) % len(stages)]])
        return pairs

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """The global rank at pipeline stage ``stage_id`` with this rank's other coordinates
        (or those overridden by ``kwargs``, e.g. ``data=1``)."""
        me = self._topo.get_coord(self.global_rank)
        return self._topo.get_rank(**me._replace(pipe=stage_id, **kwargs)._asdict())

    def topology(self) -> ProcessTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    # pipeline axis
    def get_pipe_parallel_rank(self) -> int:
        """The pipeline stage of this rank."""
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        """The number of pipeline stages."""
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> Any:
        """The ranks of this rank's pipeline (one per stage)."""
        return self.pp_proc_group

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    # data axis
    def get_data_parallel_rank(self) -> int:
        """Which pipeline (data replica) this rank is in."""
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        """The number of pipelines."""
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        """The ranks holding the same stage (and model slice) of every pipeline."""
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.dp_group)

    # model = pipe x slice: every rank of one data replica (DeepSpeed's definition)
    def get_model_parallel_rank(self) -> int:
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self) -> Any:
        return self.ds_model_proc_group

    # slice = the topology's model (tensor) axis
    def get_slice_parallel_rank(self) -> int:
        return self.topo.coords(self.global_rank).tensor

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> Any:
        return self.slice_proc_group

    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size


__all__ = [
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineParallelGrid",
    "ProcessTopology",
]

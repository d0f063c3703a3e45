"""FastGen expert parallelism: one MoE engine's experts spread over this process and workers.

``pipeline(model, expert_parallel=E)`` (or ``EngineConfig(expert_parallel=E)``) keeps
``num_experts / E`` experts of every routed layer on each of ``E`` ranks (this process
and ``E - 1`` spawned workers), replicates the dense parts, and moves the routed tokens
with all-to-all (:mod:`.dispatch`); placement math in :mod:`.placement`, the process
model is the tensor-parallel one (:mod:`.peers`, :mod:`.worker`).
"""

from shardspeed.inference.fastgen.expert_parallel.errors import ExpertParallelError
from shardspeed.inference.fastgen.expert_parallel.placement import (
    ExpertPlacement,
    check_expert_layout,
)
from shardspeed.inference.fastgen.expert_parallel.start import start_expert_parallel

__all__ = ["ExpertParallelError", "ExpertPlacement", "check_expert_layout", "start_expert_parallel"]

"""Rank 0's side of an expert-parallel engine: the tensor-parallel process machinery
(:class:`~shardspeed.inference.fastgen.tensor_parallel.peers.TensorParallelPeers`:
spawn, connect, drive each step, fail and tear down) with expert-parallel workers.

The caller's process is rank 0 and runs the whole engine (scheduler, sampler, its
replicated dense parts and its experts); ranks 1..E-1 hold the other experts. Each
step rank 0 sends the scheduled batch to every worker, then all ranks run the same
forward, whose all-to-alls keep them in step; only rank 0 computes logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.multiprocessing as mp

from shardspeed.inference.fastgen.expert_parallel.attach import attach_experts, moe_blocks
from shardspeed.inference.fastgen.expert_parallel.comm import GroupComm
from shardspeed.inference.fastgen.expert_parallel.errors import ExpertParallelError
from shardspeed.inference.fastgen.expert_parallel.placement import (
    ExpertPlacement,
    describe_placement,
)
from shardspeed.inference.fastgen.expert_parallel.worker import (
    ExpertWorkerArgs,
    expert_worker_main,
)
from shardspeed.inference.fastgen.models.tp_shard import NO_SHARD
from shardspeed.inference.fastgen.tensor_parallel.errors import TensorParallelError
from shardspeed.inference.fastgen.tensor_parallel.peers import TensorParallelPeers, worker_devices
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

_PLANS = {
    "all_to_all": "every rank routes every token (dense parts replicated), sends its 1/{ep} "
    "slice of the tokens to the experts' owners (all-to-all, uneven splits from the "
    "replicated routing, no capacity, nothing dropped), the owners run their experts in "
    "token order, the outputs return (all-to-all), each rank combines its slice (+ the "
    "shared expert) and an all-gather restores every token",
    "all_gather": "every rank routes every token (dense parts replicated), each owner runs "
    "its experts on all the tokens routed to them (token order, nothing dropped), one "
    "all-gather gives every rank every expert output, each rank combines every token "
    "(+ the shared expert)",
}


class ExpertParallelPeers(TensorParallelPeers):
    """The workers of one expert-parallel engine and the group they share with rank 0.

    Rank 0's model is built whole-dense (``shard`` is :data:`NO_SHARD`) with
    :meth:`prepare_model` keeping its experts only.
    """

    def __init__(
        self, placement: ExpertPlacement, device: torch.device, dispatch: str = "all_to_all"
    ) -> None:
        super().__init__(placement.ep_size, device)
        self.placement = placement
        self.dispatch = dispatch
        self.shard = NO_SHARD  # dense parts replicated: full heads, full KV cache
        self.comm = GroupComm(self._handle, placement.ep_size)

    @classmethod
    def spawn_experts(
        cls,
        source: Any,
        num_experts: int,
        ep_size: int,
        dtype: torch.dtype | None,
        device: torch.device,
        quantization: Any = None,
        dispatch: str = "all_to_all",
        cpu_prepack: bool | None = None,
    ) -> ExpertParallelPeers:
        """Start ranks 1..``ep_size - 1``, each loading its experts of ``source``."""
        devices = worker_devices(device, ep_size)
        peers = cls(ExpertPlacement(num_experts, ep_size, 0), device, dispatch)
        ctx = mp.get_context("spawn")
        num_threads = torch.get_num_threads()  # each rank as many as the caller
        try:
            for rank in range(1, ep_size):
                ours, theirs = ctx.Pipe(duplex=True)
                args = ExpertWorkerArgs(
                    ExpertPlacement(num_experts, ep_size, rank), source, dtype,
                    str(devices[rank]), num_threads, quantization, dispatch, cpu_prepack,
                )  # fmt: skip
                proc = ctx.Process(
                    target=expert_worker_main, args=(theirs, args), daemon=True,
                    name=f"fastgen-ep{rank}",
                )  # fmt: skip
                proc.start()
                theirs.close()
                peers._procs.append(proc)
                peers._conns.append(ours)
        except BaseException:
            peers.shutdown()
            raise
        logger.info(
            "expert parallel: %d ranks (this process + workers %s) on %s",
            ep_size, [p.pid for p in peers._procs], [str(d) for d in devices],
        )  # fmt: skip
        return peers

    def prepare_model(self, model: Any) -> None:
        """Rank 0's part of the (meta) model: its experts, routed through the group."""
        attach_experts(model, self.placement, self.comm, self.dispatch)
        logger.info(
            "expert placement: %s. Dispatch plan per routed layer (%s): %s",
            describe_placement(self.placement, len(moe_blocks(model))), self.dispatch,
            _PLANS[self.dispatch].format(ep=self.placement.ep_size),
        )  # fmt: skip

    # the machinery's errors, named for this engine (same type family: TensorParallelError)
    def _failure(self, exc: BaseException | None, what: str | None = None) -> ExpertParallelError:
        return _as_expert_error(super()._failure(exc, what))

    def _send_all(self, message: tuple[str, Any]) -> None:
        try:
            super()._send_all(message)
        except ExpertParallelError:
            raise
        except TensorParallelError as exc:
            raise _as_expert_error(exc) from exc


def _as_expert_error(exc: TensorParallelError) -> ExpertParallelError:
    return ExpertParallelError(str(exc).replace("tensor-parallel", "expert-parallel"))

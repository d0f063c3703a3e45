"""The sharded optimizer: fp32 masters of this rank's shard, updated by a torch optimizer.

``step()`` reads like the algorithm: finish gradient reduction, unscale into master
gradients, detect overflow, clip by the global norm, update, write back, all-gather.

With optimizer offload the masters live on the host: the master gradients are host
copies of the gradient shards, and the norm is reduced on the device. With NVMe offload
the groups' :class:`~shardspeed.zero.offload.OffloadRuntime` holds an
:class:`~shardspeed.zero.offload.optimizer_swapper.OptimizerSwapper`: the update swaps
one master (and its optimizer state) in at a time, and the master gradients are kept
here (``_grads``) rather than on the swapped-out masters.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from shardspeed.precision.loss_scaler import LossScaler
from shardspeed.utils.logging import get_logger
from shardspeed.zero.grad_norm import GradNorm
from shardspeed.zero.offload.host import synchronize
from shardspeed.zero.reducer import GradReducer

logger = get_logger(__name__)


@dataclass(frozen=True)
class StepResult:
    applied: bool
    grad_norm: float | None


class ShardedOptimizer:
    """Wraps the user's/config's torch optimizer, which updates per-bucket master shards.

    Exposes ``param_groups``/``state``/``state_dict`` of the inner optimizer so schedulers
    and user code that read the learning rate keep working.
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        groups: Sequence[Any],
        reducer: GradReducer,
        *,
        publish: Callable[[], None],
        grad_norm: GradNorm,
        loss_scaler: LossScaler,
        gradient_clipping: float,
        check_overflow: bool,
    ) -> None:
        self.optimizer = inner
        self.groups = groups  # FlatGroup (stages 0-2) or UnitGroup (stage 3) per param group
        self.reducer = reducer
        self.publish = publish  # the sharding's "parameter shards -> usable parameters"
        self.grad_norm = grad_norm
        self.loss_scaler = loss_scaler
        self.gradient_clipping = gradient_clipping
        self.check_overflow = check_overflow
        self._grads: list[torch.Tensor] = []  # master gradients of the current step
        runtime = getattr(groups[0], "offload", None) if groups else None
        self.swapper = runtime.optimizer_swapper if runtime is not None else None
        if self.swapper is not None:
            masters = [m for g in groups for m in g.masters]
            write_backs = [
                partial(g.copy_master_to_params, i) for g in groups for i in range(len(g.masters))
            ]
            self.swapper.attach(inner, masters, write_backs)

    # -- torch.optim.Optimizer-like surface ----------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.groups:
            group.zero_grads()
            for master in group.masters:
                master.grad = None
        self._grads = []

    @contextlib.contextmanager
    def state_resident(self, write: bool) -> Iterator[None]:
        """Masters and optimizer state readable (and, with ``write``, writable) in the block.

        A no-op unless they are swapped to NVMe: then every master and its state is read
        into host memory for the block and, with ``write``, written back (and into the
        parameter shards) on exit. The checkpoint code wraps its reads and writes in it.
        """
        if self.swapper is None:
            yield
            return
        with self.swapper.resident(write):
            yield

    def state_dict(self) -> dict[str, Any]:
        if self.swapper is None:
            return self.optimizer.state_dict()
        with self.state_resident(write=False):
            sd = self.optimizer.state_dict()
            # per-master dicts are the optimizer's own, which swapping out empties again
            return {**sd, "state": {k: dict(v) for k, v in sd["state"].items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        with self.state_resident(write=True):
            self.optimizer.load_state_dict(state_dict)

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.loss_scale

    # -- the step ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> StepResult:
        self.reducer.flush()
        self._unscale_into_master_grads(1.0 / self.loss_scaler.loss_scale)
        grad_norm = self.grad_norm(self._grads)
        if self.check_overflow and not math.isfinite(grad_norm):
            self.loss_scaler.update(overflow=True)
            self.zero_grad()
            return StepResult(applied=False, grad_norm=grad_norm)
        self._clip(grad_norm)
        self._update_masters()
        self._publish_params()
        self.loss_scaler.update(overflow=False)
        self.zero_grad()
        return StepResult(applied=True, grad_norm=grad_norm)

    @torch.no_grad()
    def step_with_zero_grads(self) -> None:
        """Step the torch optimizer once with an all-zero gradient on every master.

        DeepSpeed 0.19.8's 16-bit ZeRO-0 wrappers do this when they are built
        (``initialize_optimizer_states``): it creates the optimizer state and counts one step
        (Adam's bias correction then makes the first real update about 0.74 lr), and
        decoupled weight decay moves the masters once. The parameters are not written: the
        first forward uses the initial weights, the first real step publishes the masters.
        """
        assert self.swapper is None, "ZeRO 0 (the only caller) never swaps masters to NVMe"
        masters = [m for group in self.groups for m in group.masters]
        for master in masters:
            master.grad = torch.zeros_like(master)
        self.optimizer.step()
        for master in masters:
            master.grad = None

    def _unscale_into_master_grads(self, inv_scale: float) -> None:
        # optimizer_grad() starts the device -> host copies (offload); wait for them once
        pairs = [
            (master, group.optimizer_grad(bucket))
            for group in self.groups
            for bucket, master in zip(group.buckets, group.masters)
        ]
        if any(g.device.type == "cpu" for _, g in pairs):
            synchronize(self._device())  # no-op when the device is the CPU
        self._grads = []
        for master, grad in pairs:
            if grad.dtype == master.dtype:
                if inv_scale != 1.0:
                    grad.mul_(inv_scale)
            else:
                grad = grad.to(master.dtype).mul_(inv_scale)
            self._grads.append(grad)
            if self.swapper is None:  # a swapped-out master has no data to match
                master.grad = grad

    def master_grads(self) -> list[torch.Tensor]:
        return list(self._grads)

    def _device(self) -> torch.device:
        """The device collectives run on (where the parameter shards are)."""
        return self.groups[0].device if self.groups else torch.device("cpu")

    def _clip(self, grad_norm: float) -> None:
        if self.gradient_clipping <= 0:
            return
        coef = self.gradient_clipping / (grad_norm + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_(self.master_grads(), coef)

    def _update_masters(self) -> None:
        """The torch optimizer's update of every master (one at a time when swapped)."""
        if self.swapper is None:
            self.optimizer.step()
        else:
            self.swapper.step(list(self._grads))

    def _copy_masters_to_params(self) -> None:
        """Masters -> parameter shards (the NVMe swapper did it as each master stepped)."""
        if self.swapper is None:
            for group in self.groups:
                group.copy_masters_to_params()

    def _publish_params(self) -> None:
        """Write masters into the parameter shards and make the parameters usable again
        (all-gather at stages 1/2, release the gathered units at stage 3)."""
        self._copy_masters_to_params()
        self.publish()

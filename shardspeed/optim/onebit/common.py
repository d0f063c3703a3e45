"""What the three 1-bit optimizers share: the data-parallel group, averaging, error buffers.

These optimizers average gradients themselves (``reduces_gradients = True``): the engine
then leaves every rank's gradients unreduced (:class:`~shardspeed.zero.grad_reduction.LocalGradients`)
and each ``step()`` runs either a full-precision all-reduce (warm-up) or the compressed
all-reduce of :mod:`shardspeed.optim.onebit.compressed_allreduce`.

State, and where a checkpoint finds it:

* elementwise tensors of a master's size that are the same on every rank (``exp_avg``,
  ``exp_avg_sq``, ...) and scalars (``step``, ...) live in ``self.state[master]``, where the
  engine's checkpoint saves them by parameter fragment;
* the error-feedback buffers differ between ranks, so they are kept out of ``self.state``
  (a stage-0 checkpoint writes rank 0's replica only). :meth:`rank_local_state` /
  :meth:`load_rank_local_state` hand them (and whatever else differs per rank) to a
  per-rank store; ``state_dict()`` includes them under ``"rank_local"``. When the state is
  replaced from outside without them (a checkpoint loaded at another world size), the
  buffers restart at zero, which is what DeepSpeed always did.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from shardspeed import comm
from shardspeed.optim.onebit.compressed_allreduce import CompressedAllReduce, ErrorFeedback
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

COMM_BACKEND_NAMES = ("nccl", "mpi", "hccl", "compressed", "gloo")
"""DeepSpeed's ``comm_backend_name`` values (plus ``gloo``): all run on ``torch.distributed``."""

Key = tuple[int, int]  # (param group index, index of the master in the group)


class OnebitOptimizer(torch.optim.Optimizer):
    """Base of ``OnebitAdam``, ``ZeroOneAdam`` and ``OnebitLamb``.

    ``comm_group`` is the data-parallel process group the gradients are averaged over
    (None: the default group, i.e. every rank). The engine may set the attribute before
    the first ``step()``; it is read then.
    """

    reduces_gradients = True  # the engine gives this optimizer unreduced local gradients
    elementwise = True  # steps whole flat buckets (LAMB: per parameter segment, see lamb.py)
    _title = "1-bit optimizer"

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        amsgrad: bool,
        cuda_aware: bool,
        comm_backend_name: str,
        comm_group: Any,
    ) -> None:
        if amsgrad:
            raise ValueError(
                f"{self._title}: amsgrad=true is not supported (nor was it in DeepSpeed). "
                "Fix: remove optimizer.params.amsgrad."
            )
        if comm_backend_name not in COMM_BACKEND_NAMES:
            raise ValueError(
                f"{self._title}: comm_backend_name={comm_backend_name!r} is not one of "
                f"{list(COMM_BACKEND_NAMES)}. Every value runs the same compressed all-reduce "
                "on torch.distributed's own backend; remove the key or use 'nccl'."
            )
        for name in ("lr", "eps", "weight_decay"):
            if defaults[name] < 0:
                raise ValueError(f"{self._title}: {name}={defaults[name]!r} must be >= 0.")
        beta1, beta2 = defaults["betas"]
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"{self._title}: betas={defaults['betas']!r} must lie in [0, 1).")
        defaults["betas"] = (float(beta1), float(beta2))
        super().__init__(params, defaults)
        self.cuda_aware = bool(cuda_aware)  # accepted for DeepSpeed configs; unused
        self.comm_backend_name = comm_backend_name
        self.comm_group = comm_group
        self._compressed: CompressedAllReduce | None = None
        self._errors: dict[Key, ErrorFeedback] = {}
        self._state_owner: dict[Key, dict[str, Any]] = {}  # detects state loaded from outside
        self._checked = False  # check_replicated ran

    # -- communication ---------------------------------------------------------------------
    @property
    def compressed(self) -> CompressedAllReduce:
        """The compressed all-reduce over the data-parallel group (built at first use)."""
        if self._compressed is None:
            if dist.is_available() and dist.is_initialized():
                world, rank = dist.get_world_size(self.comm_group), dist.get_rank(self.comm_group)
            else:
                world, rank = 1, 0
            self._compressed = CompressedAllReduce(self.comm_group, world, rank)
        return self._compressed

    @property
    def world_size(self) -> int:
        return self.compressed.world_size

    def average_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Full-precision average of ``tensor`` over the group, in place (warm-up)."""
        if self.world_size > 1:
            comm.all_reduce(tensor, group=self.comm_group)
            tensor.div_(self.world_size)
        return tensor

    def compressed_average(self, key: Key, tensor: torch.Tensor) -> torch.Tensor:
        """1-bit average of ``tensor`` with the error buffers of master ``key``."""
        errors = self._errors.get(key)
        if errors is None:
            errors = self.compressed.new_errors(tensor.numel(), tensor.device)
            self._errors[key] = errors
        return self.compressed(tensor, errors)

    def check_replicated(self) -> None:
        """Refuse sharded masters, once, before the first step from scratch.

        The algorithms need every rank to hold the whole master (ZeRO stage 0, as in
        DeepSpeed, which refused ZeRO for them): at stages >= 1 each rank's masters are a
        different slice, which one fingerprint all-reduce (max of +-sum) exposes.
        """
        if self._checked or self.world_size == 1:
            return
        self._checked = True
        masters = [p for g in self.param_groups for p in g["params"]]
        if any(self.state.get(p) for p in masters):
            return  # resumed: 0/1 Adam's local steps legitimately differ per rank
        total = sum(float(p.detach().double().sum()) for p in masters)
        device = masters[0].device if masters else torch.device("cpu")
        both = torch.tensor([total, -total], dtype=torch.float64, device=device)
        comm.all_reduce(both, op=dist.ReduceOp.MAX, group=self.comm_group)
        if both[0].item() != -both[1].item():
            raise ValueError(
                f"{self._title}: the masters differ between data-parallel ranks at the first "
                "step: the engine shards them (zero_optimization.stage >= 1) or the ranks "
                "started from different weights. The 1-bit optimizers need identical whole "
                "replicas on every rank (ZeRO stage 0, as in DeepSpeed). Fix: set "
                "zero_optimization.stage to 0 and initialise the model identically (same seed)."
            )

    def reset_errors(self) -> None:
        """Forget every error-feedback buffer (they restart at zero)."""
        for errors in self._errors.values():
            errors.worker.zero_()
            errors.server.zero_()

    # -- iteration and state ---------------------------------------------------------------
    def masters(self) -> Iterator[tuple[Key, dict[str, Any], torch.Tensor]]:
        """``(key, group, master)`` for every master that has a gradient this step."""
        for gi, group in enumerate(self.param_groups):
            if "exp_avg_mask" in group:
                raise ValueError(
                    f"{self._title}: param group {gi} sets 'exp_avg_mask', a per-parameter mask "
                    "that does not apply to the engine's flat buckets. Remove it (parameters "
                    "whose momentum is always zero only cost a little compression error)."
                )
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError(f"{self._title} does not support sparse gradients.")
                yield (gi, pi), group, p

    def state_of(self, key: Key, p: torch.Tensor) -> dict[str, Any]:
        """``self.state[p]``; if it was replaced from outside since the last step (a
        checkpoint was loaded), the rank-local buffers of ``key`` are dropped first."""
        state = self.state[p]
        owner = self._state_owner.get(key)
        if owner is not None and owner is not state:
            self._drop_rank_local(key)
        self._state_owner[key] = state
        return state

    def _drop_rank_local(self, key: Key) -> None:
        self._errors.pop(key, None)

    def _keys(self) -> Iterator[tuple[Key, torch.Tensor]]:
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                yield (gi, pi), p

    def rank_local_state(self) -> dict[str, torch.Tensor]:
        """This rank's state that other ranks do not share, as flat tensors by name
        (``"g{group}.m{master}.{what}"``): the error-feedback buffers, plus what a subclass
        adds. Save it per rank; restore with :meth:`load_rank_local_state`."""
        out: dict[str, torch.Tensor] = {}
        for (gi, pi), errors in sorted(self._errors.items()):
            out[f"g{gi}.m{pi}.worker_error"] = errors.worker
            out[f"g{gi}.m{pi}.server_error"] = errors.server
        return out

    def load_rank_local_state(self, tensors: Mapping[str, torch.Tensor] | None) -> None:
        """Restore :meth:`rank_local_state` (after the shared state was loaded); ``None`` or
        buffers of another shape (another world size) restart the errors at zero."""
        self._errors.clear()
        tensors = dict(tensors or {})
        for key, p in self._keys():
            gi, pi = key
            self._state_owner[key] = self.state[p]
            worker = tensors.get(f"g{gi}.m{pi}.worker_error")
            server = tensors.get(f"g{gi}.m{pi}.server_error")
            if worker is None or server is None:
                continue
            layout = self.compressed.layout(p.numel())
            if worker.numel() != layout.padded_numel or server.numel() != layout.chunk_numel:
                logger.warning(
                    f"{self._title}: saved error buffers of group {gi} master {pi} do not match "
                    f"world size {self.world_size}; they restart at zero"
                )
                continue
            errors = ErrorFeedback.zeros(layout, p.device)
            errors.worker.copy_(worker.reshape(-1))
            errors.server.copy_(server.reshape(-1))
            self._errors[key] = errors

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["rank_local"] = {k: v.detach().clone() for k, v in self.rank_local_state().items()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        rank_local = state_dict.pop("rank_local", None)
        super().load_state_dict(state_dict)
        self.load_rank_local_state(rank_local)


def adam_direction(
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    group: dict[str, Any],
    *,
    momentum_steps: int,
    variance_steps: int,
) -> tuple[torch.Tensor, float]:
    """``(denom, step_size)`` of an Adam update ``p -= step_size * exp_avg / denom``.

    With ``bias_correction`` the moments are divided by ``1 - beta**k``, ``k`` the number
    of updates each received (a frozen variance keeps the correction of its last update).
    ``eps_inside_sqrt``: ``denom = sqrt(v_hat + eps)``, else ``sqrt(v_hat) + eps``.
    """
    beta1, beta2 = group["betas"]
    bc1, bc2 = 1.0, 1.0
    if group["bias_correction"]:
        bc1 = 1.0 - beta1**momentum_steps
        bc2 = 1.0 - beta2**variance_steps
    if group["eps_inside_sqrt"]:
        denom = (exp_avg_sq / bc2).add_(group["eps"]).sqrt_()
    else:
        denom = (exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(group["eps"])
    return denom, group["lr"] / bc1


def apply_adam_update(
    p: torch.Tensor, exp_avg: torch.Tensor, denom: torch.Tensor, step_size: float, group: dict
) -> None:
    """``p -= lr * weight_decay * p`` (decoupled, as DeepSpeed's 1-bit Adam) then the Adam step."""
    if group["weight_decay"] != 0:
        p.mul_(1.0 - group["lr"] * group["weight_decay"])
    p.addcdiv_(exp_avg, denom, value=-step_size)

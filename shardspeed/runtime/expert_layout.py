"""Which mesh axis each optimizer param group is sharded, reduced and normed over.

Dense parameters live on the engine's ``data`` axis. Expert parameters of an MoE layer
(``param.allreduce = False``, ``param.group_name = "ep_size_<ep>"``, set by
:mod:`shardspeed.parallel.moe`) differ across the ``expert`` axis of their ep topology and
are replicated over its ``expert_data`` axis, so (as in DeepSpeed):

* their gradients are summed over ``expert_data`` and divided by the full data-parallel
  size (the loss is a mean over every data rank's tokens; each expert saw tokens of its
  whole expert group);
* at ZeRO >= 1 they are sharded over ``expert_data``;
* the clipping norm is DeepSpeed's by default (``MOE_GRAD_NORMS``): sharded (ZeRO >= 1)
  the true global norm, squares summed over ``expert_data`` and ``expert``; at stage 0
  with fp32 parameters DeepSpeed's ``clip_grad_norm_`` rule, each rank's norm over the
  gradients it holds (dense and its own experts) averaged over the data ranks, which is
  at most the true norm; at stage 0 with bf16/fp16 parameters the rule of DeepSpeed's
  16-bit wrapper, which depends on the optimizer (:func:`expert_norm_groups`).
  ``"global"`` gives the true norm at every stage.

Each optimizer param group must be all dense or all experts of one ``group_name``: groups
that mix them are split here for config-built optimizers (DeepSpeed's
``split_params_into_different_moe_groups_for_optimizer`` layout), and refused for a client
optimizer instance, whose groups cannot change under it.
"""

from __future__ import annotations

from typing import Any

import torch

from shardspeed.config.optimizer import OptimizerConfig
from shardspeed.ops.adam import FusedAdam
from shardspeed.zero.grad_norm import OverflowOnly, RankNormMean
from shardspeed.zero.sharding import ShardAxis


def expert_name(params: list[torch.nn.Parameter]) -> str | None:
    """The expert group name shared by ``params``, None if dense; ValueError if mixed."""
    names = {getattr(p, "group_name", None) if _is_expert(p) else None for p in params}
    if len(names) > 1:
        raise ValueError(
            "an optimizer param group mixes dense and expert parameters (or experts of "
            f"different ep sizes: {sorted(str(n) for n in names)}); the engine reduces each "
            "group over one axis. Build the optimizer's groups with "
            "shardspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer."
        )
    return names.pop() if names else None


def split_expert_groups(
    groups: list[dict[str, Any]], client_optimizer: bool
) -> list[dict[str, Any]]:
    """Split groups mixing dense and expert parameters (config / callable optimizers)."""
    out: list[dict[str, Any]] = []
    for group in groups:
        by_name: dict[str | None, list[torch.nn.Parameter]] = {}
        for p in group["params"]:
            by_name.setdefault(
                getattr(p, "group_name", None) if _is_expert(p) else None, []
            ).append(p)
        if len(by_name) <= 1:
            out.append(group)
            continue
        if client_optimizer:
            expert_name(group["params"])  # raises with the fix
        for name, params in by_name.items():
            extra = {} if name is None else {"moe": True, "name": name}
            out.append({**group, **extra, "params": params})
    return out


def expert_axis(name: str) -> ShardAxis:
    """The ``expert_data`` axis of the ep topology named ``name`` (``"ep_size_<ep>"``)."""
    topo = _topology(name)
    return ShardAxis(
        topo.group("expert_data"), topo.size("expert_data"), topo.rank_in("expert_data")
    )


MOE_GRAD_NORMS = ("deepspeed", "global")


def expert_norm_groups(
    name: str,
    sharded: bool,
    grad_norm: str = "deepspeed",
    low_precision: bool = False,
    fused_adam: bool = False,
) -> list[Any]:
    """Groups to sum an expert group's squared gradient norm over.

    ``grad_norm="deepspeed"`` (default): DeepSpeed 0.19.8's clipping norm.

    * Sharded (ZeRO >= 1): its ZeRO optimizer sums every rank's partition (the true norm;
      its ``_average_expert_grad_norms`` then averages equal values). Checked against
      DeepSpeed runs in fp32 and bf16.
    * Unsharded, fp32 parameters: its ``clip_grad_norm_`` averages the ranks' own norms
      over the data-parallel group: a :class:`~shardspeed.zero.grad_norm.RankNormMean`
      over the topology's ``data`` axis. Checked against DeepSpeed runs.
    * Unsharded, 16-bit parameters (``low_precision``), ``fused_adam=True`` (what
      :func:`uses_fused_adam` says): its ``FP16_Optimizer`` adds every expert group's
      norm over the expert axis (``get_norm_with_moe_layers``), the true norm. Checked
      against DeepSpeed bf16 runs with ``"optimizer": {"type": "Adam"}``.
    * Unsharded, 16-bit, any other optimizer (a client ``torch.optim`` instance, Lamb,
      ``torch_adam``): its ``FP16_UnfusedOptimizer`` clips by the norm of the dense
      gradients alone; expert gradients only take part in the overflow check: an
      :class:`~shardspeed.zero.grad_norm.OverflowOnly` over the ``data`` axis. Checked
      against DeepSpeed bf16 runs with a client ``torch.optim.Adam`` (2 and 4 ranks).

    ``grad_norm="global"``: the true global norm at every stage.
    """
    if grad_norm not in MOE_GRAD_NORMS:
        raise ValueError(
            f"MoE grad_norm={grad_norm!r}: valid values are {list(MOE_GRAD_NORMS)} "
            "('deepspeed': DeepSpeed's clipping norm, the default; 'global': the true norm)."
        )
    topo = _topology(name)
    if sharded:
        return [topo.group("expert_data"), topo.group("expert")]
    if grad_norm == "global" or (low_precision and fused_adam):
        return [topo.group("expert")]
    if low_precision:
        return [OverflowOnly(topo.group("data"))]
    if topo.size("data") == 1:
        return [topo.group("expert")]
    return [RankNormMean(topo.group("data"), topo.size("data"))]


def uses_fused_adam(
    optimizer: torch.optim.Optimizer | None, config_optimizer: OptimizerConfig | None
) -> bool:
    """Whether DeepSpeed would step this optimizer as ``FusedAdam``, which picks its
    16-bit stage-0 wrapper (and so the MoE clipping norm, :func:`expert_norm_groups`).

    DeepSpeed builds ``FusedAdam`` for ``"optimizer": {"type": "Adam" | "AdamW"}`` unless
    ``params.torch_adam`` is true (ShardSpeed builds torch's Adam there, so the config
    decides); a client optimizer counts when it is a ``FusedAdam`` instance.
    """
    if isinstance(optimizer, FusedAdam):
        return True
    if config_optimizer is None:
        return False
    params = config_optimizer.params or {}
    adam = config_optimizer.type.lower() in ("adam", "adamw")
    return adam and not params.get("torch_adam", False)


def expert_parallel_size(name: str) -> int:
    from shardspeed.parallel.moe.groups import ep_size_of

    return ep_size_of(name)


def _topology(name: str) -> Any:
    from shardspeed.parallel.moe.groups import ep_size_of, topology_for

    return topology_for(ep_size_of(name))


def _is_expert(param: torch.nn.Parameter) -> bool:
    return hasattr(param, "allreduce") and not param.allreduce

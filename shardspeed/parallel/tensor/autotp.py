"""AutoTP: shard a Hugging Face model's linear layers over the tensor axis, in place.

``tp_model_init(model, tp_size, dtype)`` (``deepspeed.tp_model_init``'s signature) picks a
:class:`~.policies.TPPolicy`, then::

    head:     a head tied to the input embedding -> vocabulary-parallel head + embedding,
              and the model's loss_function becomes the vocabulary-parallel loss
    layers:   each nn.Linear / Conv1D the policy names -> ColumnParallelLinear or
              RowParallelLinear, sliced from the full weight (widths: KV-head groups for
              attention, near-even for the rest, as DeepSpeed AutoTP; with fewer KV heads
              than ranks the spare ranks get zero-width attention shards, as DeepSpeed's)
    fixups:   attention attributes that count heads become rank-local (GPT-2 split_size)
    sync:     replicated parameters are broadcast from tensor rank 0 (they must be equal)
    dtype:    model.to(dtype)

The shards are exactly DeepSpeed 0.19.8's for models both support (tests/dist/test_autotp.py
compares them rank by rank). Names and layouts are unchanged, so ``model.state_dict()`` has
the same keys (holding shards); :mod:`~.state` gathers or loads full tensors.
Call it before building the optimizer: sharded parameters are new ``nn.Parameter`` objects.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardspeed import comm
from shardspeed.parallel.tensor.cross_entropy import VocabParallelCausalLMLoss
from shardspeed.parallel.tensor.empty_heads import guard_empty_attention
from shardspeed.parallel.tensor.groups import topology_for
from shardspeed.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    is_conv1d,
)
from shardspeed.parallel.tensor.partition import ShardLayout, autotp_split
from shardspeed.parallel.tensor.policies import (
    LayerRule,
    TPPolicy,
    head_counts,
    model_type_of,
    policy_for,
    splits_by_kv_heads,
)
from shardspeed.utils.logging import log_dist

_TP_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


@dataclass(frozen=True)
class TensorParallelPlan:
    """What :func:`shard_model` did, attached to the model as ``model.shardspeed_tp``."""

    tp_size: int
    group: Any
    policy: str
    # (module name, "column" | "row" | "vocab" | "vocab_embedding") per sharded layer
    layers: tuple[tuple[str, str], ...]
    vocab_parallel_head: str | None  # the head's module name when its logits are rank-local


def tp_model_init(
    model: nn.Module,
    tp_size: int,
    dtype: torch.dtype | None,
    tp_group: Any = None,
    *,
    partition_config: Mapping[str, Any] | None = None,
    preset_model: str | None = None,
    vocab_parallel_lm_head: bool | None = None,
) -> nn.Module:
    """Shard ``model`` in place for ``tp_size``-way tensor parallelism and return it.

    ``tp_group`` defaults to the tensor axis of :func:`~.groups.topology_for` ``(tp_size)``
    (DeepSpeed's grid: adjacent ranks). ``partition_config`` / ``preset_model`` are
    ``tensor_parallel``'s keys of the same names. ``vocab_parallel_lm_head``: ``None`` shards
    a head tied to the input embedding over the vocabulary (rank-local logits) and keeps an
    untied one column-parallel with gathered logits; ``True``/``False`` force either.
    Collective over the world (group creation) and the tensor group (replicated sync);
    initialises ``torch.distributed`` from the launcher's environment if needed.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_model_init(tp_size={tp_size!r}): tp_size must be an int >= 1.")
    if getattr(model, "shardspeed_tp", None) is not None:
        raise ValueError(
            "tp_model_init: this model is already tensor-parallel; call it once per model."
        )
    if tp_size > 1 and not comm.is_initialized():
        comm.init_distributed()  # from torchrun's environment, as deepspeed.initialize would
    group = _resolve_group(tp_size, tp_group)
    if tp_size > 1:
        from shardspeed.zero.init_partition import materialize_init_params

        # a model built under zero.Init: gather its full weights first (collective), then
        # slice them; at ZeRO-3 the engine shards the slices over the data axis again
        materialize_init_params(model, "tp_model_init slices full weights")
        policy = policy_for(model, partition_config, preset_model)
        shard_model(model, policy, group, vocab_parallel_lm_head=vocab_parallel_lm_head)
    if dtype is not None:
        model.to(dtype)
    return model


def _resolve_group(tp_size: int, tp_group: Any) -> Any:
    if tp_group is None:
        return topology_for(tp_size).group("tensor") if tp_size > 1 else None
    size = comm.get_world_size(tp_group)
    if size != tp_size:
        raise ValueError(
            f"tp_model_init: tp_size={tp_size} but tp_group has {size} ranks; pass the tensor "
            "group of that size (or tp_group=None to build one)."
        )
    return tp_group


def shard_model(
    model: nn.Module, policy: TPPolicy, group: Any, *, vocab_parallel_lm_head: bool | None = None
) -> TensorParallelPlan:
    """Replace the layers ``policy`` names with tensor-parallel layers over ``group``."""
    tp_size = comm.get_world_size(group)
    num_kv_heads, _ = head_counts(model)
    model_type = model_type_of(model)
    modules = dict(model.named_modules())
    done: dict[str, str] = {}
    empty: list[str] = []  # layers some ranks hold none of (fewer KV heads than ranks)

    head = _shard_head(model, modules, policy, group, vocab_parallel_lm_head, done)
    for name, module in modules.items():
        if name in done or not (isinstance(module, nn.Linear) or is_conv1d(module)):
            continue
        rule = policy.rule_for(name, model_type)
        if rule is None or rule.style == "skip":
            continue
        if _is_shared(module.weight, modules, name):
            log_dist(f"AutoTP: {name}.weight is shared with another module; left replicated.")
            continue
        layout = _layout(module, rule, name, tp_size, num_kv_heads)
        if min(layout.shard_sizes) == 0:
            empty.append(f"{name} {list(layout.shard_sizes)}")
        if rule.style == "column":
            new = ColumnParallelLinear.from_module(
                module, layout, group=group, gather_output=rule.gather_output
            )
        else:
            new = RowParallelLinear.from_module(module, layout, group=group)
        _replace(model, name, new)
        done[name] = rule.style

    if empty:
        # as DeepSpeed: a width-0 rank adds zeros to the row-parallel sum, so results are exact
        guard_empty_attention(model, comm.get_rank(group))  # no kernel sees zero heads
        log_dist(
            f"AutoTP: {len(empty)} layers have zero-width shards on some of the {tp_size} tensor "
            f"ranks (num_kv_heads={num_kv_heads}); those ranks hold none of them, e.g. {empty[0]}.",
            level=logging.WARNING,
        )
    for module in model.modules():
        for fixup in policy.fixups:
            fixup(module)
    for param_name, param in model.named_parameters():
        rule = policy.match(param_name, model_type)
        if rule is not None and rule.grad_allreduce:  # e.g. Qwen3's q_norm on sharded heads
            _sum_gradients_over_tensor_axis(param, group)
    _sync_replicated(model, group)
    sharded = tuple((name, style) for name, style in done.items() if style != "replicated")
    plan = TensorParallelPlan(tp_size, group, policy.name, sharded, head)
    model.shardspeed_tp = plan
    model.ds_autotp_parsed = True  # DeepSpeed's marker: "already sharded"
    log_dist(
        f"AutoTP ({policy.name}): tp={tp_size}, sharded {len(sharded)} layers; head: {head or 'not vocab-parallel'}"
    )
    return plan


def _layout(
    module: nn.Module, rule: LayerRule, name: str, tp_size: int, num_kv: int | None
) -> ShardLayout:
    """The split of ``module``'s output (column) or input (row) features."""
    out_features, in_features = (
        (module.nf, module.weight.shape[0]) if is_conv1d(module) else module.weight.shape
    )
    dim, total = (0, out_features) if rule.style == "column" else (1, in_features)
    aligned = splits_by_kv_heads(name)
    widths = [
        autotp_split(size, tp_size, num_kv_heads=num_kv, head_aligned=aligned)
        for size in rule.split_sizes(total, name)
    ]
    layout = ShardLayout.fused(dim, widths)
    return layout


def _shard_head(
    model: nn.Module,
    modules: dict[str, nn.Module],
    policy: TPPolicy,
    group: Any,
    vocab_parallel: bool | None,
    done: dict[str, str],
) -> str | None:
    """Shard the LM head over the vocabulary when asked (or tied); returns its name if so."""
    heads = [n for n, m in modules.items() if isinstance(m, nn.Linear) and policy.is_head(n)]
    if len(heads) != 1:
        if vocab_parallel:
            raise ValueError(
                f"vocab_parallel_lm_head=True needs exactly one nn.Linear named {policy.head_names}, "
                f"found {heads or 'none'}."
            )
        return None
    (head_name,) = heads
    head = modules[head_name]
    tied = [
        n for n, m in modules.items() if isinstance(m, nn.Embedding) and m.weight is head.weight
    ]
    if vocab_parallel is None:
        vocab_parallel = bool(tied) and policy.tied_head == "vocab"
    if not vocab_parallel:
        for name in (head_name, *tied) if tied else ():
            done[name] = "replicated"  # a tied pair stays whole, as in DeepSpeed
        return None
    tp_size = comm.get_world_size(group)
    layout = ShardLayout.of(
        0, autotp_split(head.out_features, tp_size, num_kv_heads=None, head_aligned=False)
    )
    if min(layout.shard_sizes) == 0:  # DeepSpeed refuses this too
        raise ValueError(
            f"vocab_parallel_lm_head: {head_name} has {head.out_features} vocabulary rows, fewer "
            f"than tp_size={tp_size}, so some ranks would hold no vocabulary shard; use a "
            "vocabulary of at least tp_size rows or vocab_parallel_lm_head=False."
        )
    loss = VocabParallelCausalLMLoss(
        group, layout.ranges(comm.get_rank(group))[0][0], head.out_features
    )
    for name in tied:
        VocabParallelEmbedding.check_supported(modules[name])
    _install_loss(model, loss)  # before any weight moves: a refusal leaves the model whole
    new_head = ColumnParallelLinear.from_module(head, layout, group=group, gather_output=False)
    _replace(model, head_name, new_head)
    done[head_name] = "vocab"
    for name in tied:
        embedding = VocabParallelEmbedding.from_module(
            modules[name], layout, group=group, weight=new_head.weight
        )
        _replace(model, name, embedding)
        done[name] = "vocab_embedding"
    return head_name


def _install_loss(model: nn.Module, loss: VocabParallelCausalLMLoss) -> None:
    if not hasattr(model, "loss_function"):
        log_dist(
            "AutoTP: vocab-parallel head without a loss_function hook: use vocab_parallel_cross_entropy."
        )
        return
    try:
        model.loss_function = loss
    except (AttributeError, TypeError) as exc:
        raise ValueError(
            f"AutoTP: cannot install the vocabulary-parallel loss on {type(model).__name__} "
            f"({exc}); pass vocab_parallel_lm_head=False to keep full logits."
        ) from exc
    if model.loss_function is not loss:
        raise ValueError(
            f"AutoTP: {type(model).__name__}.loss_function ignores assignment; pass "
            "vocab_parallel_lm_head=False to keep full logits."
        )


def _is_shared(weight: nn.Parameter, modules: dict[str, nn.Module], name: str) -> bool:
    return any(
        other != name and getattr(m, "weight", None) is weight for other, m in modules.items()
    )


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _sum_gradients_over_tensor_axis(param: nn.Parameter, group: Any) -> None:
    """A replicated weight applied to sharded activations gets partial gradients: sum them."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group=group)
        return grad

    if not getattr(param, "tp_grad_allreduce", False):
        param.register_hook(hook)
        param.tp_grad_allreduce = True


@torch.no_grad()
def _sync_replicated(model: nn.Module, group: Any) -> None:
    """Replicated parameters must be equal on every tensor rank: take tensor rank 0's."""
    src = comm.get_global_rank(group, 0)
    for param in model.parameters():
        if not getattr(param, "tensor_model_parallel", False):
            comm.broadcast(param.data, src=src, group=group)

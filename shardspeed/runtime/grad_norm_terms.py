"""The engine's gradient norm: which master slices are summed over which mesh axes.

:class:`~shardspeed.zero.grad_norm.GradNorm` sums squared norms of master-gradient
slices and all-reduces each sum over a list of groups. This module decides those lists
from the mesh, once, when the engine is built. A gradient element must be counted exactly
once over the ranks that hold it, so each slice's squares are summed over every axis whose
ranks hold *different* elements of it:

* dense slices (the default term): the data axis when masters are sharded over it (or
  gradients stay local), and the pipe axis (stages hold different layers);
* tensor-parallel shards: the default axes and the tensor axis (replicated parameters
  count once, in the default term);
* a pipeline's tied copies on later stages: nowhere (the owning stage counts them);
* experts of ``ep_size_<n>``: their expert axes
  (:func:`~shardspeed.runtime.expert_layout.expert_norm_groups`) and the pipe axis.

At stage 0 every data rank holds the same reduced gradients, so the data axis is left out;
a self-reducing optimizer (1-bit family) leaves gradients local, so their squares are
summed over data and divided by the data size, and every rank clips and detects overflow
alike. Every rank builds the same terms.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from shardspeed.runtime.expert_layout import expert_name, expert_norm_groups
from shardspeed.topology import Topology
from shardspeed.zero.fragments import param_fragments
from shardspeed.zero.grad_norm import GradNorm, NormTerm

# (index into all masters, lo, hi): one rank-local fragment of a parameter's gradient
MasterSlice = tuple[int, int, int]


def build_grad_norm(
    topology: Topology,
    flat_groups: Sequence[Any],
    *,
    dense_axis: str,
    sharded: bool,
    local_grads: bool,
    replicated: Sequence[nn.Parameter],
    moe_grad_norm: str,
    low_precision: bool,
    fused_adam: bool,
    device: torch.device,
) -> GradNorm:
    """The norm over ``flat_groups``' masters (see the module docstring for the terms).

    ``sharded``: the layout shards masters over the data axis (ZeRO >= 1);
    ``local_grads``: the optimizer reduces gradients itself; ``replicated``: parameters
    counted by another rank (a pipeline's tied copies); ``moe_grad_norm``,
    ``low_precision`` and ``fused_adam`` pick the experts' rule.
    """
    topo = topology
    axes = [
        a
        for a in (dense_axis, "pipe")
        if topo.size(a) > 1 and (a != dense_axis or sharded or local_grads)
    ]
    default = [topo.group(a) for a in axes]
    skip = {id(p) for p in replicated}
    terms = []
    if skip:
        terms.append(NormTerm(master_slices(flat_groups, lambda p: id(p) in skip), None))
    if topo.size("tensor") > 1:
        sharded_tp = master_slices(
            flat_groups, lambda p: getattr(p, "tensor_model_parallel", False)
        )
        terms.append(NormTerm(sharded_tp, [*default, topo.group("tensor")]))
    pipe = [topo.group("pipe")] if topo.size("pipe") > 1 else []
    names = dict.fromkeys(n for g in flat_groups if (n := expert_name(g.params)))
    for name in names:
        slices = master_slices(flat_groups, lambda p, n=name: getattr(p, "group_name", None) == n)
        expert_axes = expert_norm_groups(
            name, sharded, moe_grad_norm, low_precision=low_precision, fused_adam=fused_adam
        )
        terms.append(NormTerm(slices, [*expert_axes, *pipe]))
    divide = float(topo.size(dense_axis)) if local_grads else 1.0
    return GradNorm(default, device, terms, divide=divide)


def master_slices(
    flat_groups: Sequence[Any], keep: Callable[[nn.Parameter], bool]
) -> list[MasterSlice]:
    """``(index into all masters, lo, hi)`` of this rank's fragments of matching params."""
    out: list[MasterSlice] = []
    base = 0
    for group in flat_groups:
        out += [
            (base + f.master_index, f.local, f.local + f.length)
            for f in param_fragments(group)
            if keep(f.param)
        ]
        base += len(group.masters)
    return out

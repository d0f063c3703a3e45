"""Muon (Jordan et al., 2024) with an auxiliary AdamW: DeepSpeed's ``"type": "Muon"``.

Every param group is a Muon group or an AdamW group (``use_muon``). For a 2-D weight ``W``
(conv filters: viewed as ``(out, -1)``) with gradient ``g``, per step::

    m = beta m + (1 - beta) g                    # momentum (beta = "momentum")
    u = (1 - beta) g + beta m                    # Nesterov (else u = m)
    O = NewtonSchulz(u) * sqrt(max(1, rows/cols))  # ~ U V^T of u (shardspeed.ops.newton_schulz)
    W = W (1 - lr wd) - lr O

Embeddings, LM heads, norms, biases and every non-2-D tensor train with AdamW instead
(:func:`uses_muon`: the rule, overridable per parameter or per param group).

**Flat masters.** The engine steps flat buckets of concatenated parameters, sharded over
the data ranks at ZeRO 1-3 (at stage 3 each layer unit is one bucket, also under
``zero.Init``). The momentum and ``u`` are elementwise, but Newton-Schulz needs each
matrix whole, so the engine hands over every parameter's place in the buckets
(:meth:`Muon.set_matrix_layout`). Where a bucket is sharded, every matrix has one owner
among the ranks holding a piece of it (balanced by size); per step, one all-to-all sends
each owner the pieces of its matrices, the owner orthogonalises them, and a second
all-to-all returns each rank its slice (:mod:`shardspeed.ops.muon_owners`). Results equal
unsharded Muon. With tensor parallelism a column- or row-parallel weight's fragment also
carries a ``split``: its matrix is all-gathered over the tensor axis, orthogonalised
whole, and cut back to this rank's rows or columns. AdamW groups are elementwise and
need nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.optim import Optimizer

from shardspeed.ops._validate import check_betas, check_non_negative
from shardspeed.ops.muon_owners import (
    BucketMatrix,
    ExchangePlan,
    assign_owners,
    exchange,
    plan_exchange,
)
from shardspeed.ops.newton_schulz import NS_METHODS, orthogonalise
from shardspeed.utils.logging import warning_once

NS_DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ADAM_NAMES = ("embed", "lm_head")  # DeepSpeed's name rule for AdamW parameters


def uses_muon(name: str, param: Tensor, embeddings: set[int]) -> bool:
    """The rule: Muon for tensors with >= 2 dimensions except embeddings (``nn.Embedding``
    weights, ``id`` in ``embeddings``, and names containing ``embed``) and LM heads (names
    containing ``lm_head``, or tied to an embedding). A ``use_muon`` attribute on the
    parameter overrides it. Parameters partitioned by ``zero.Init`` count by their full
    shape (``ds_shape``), not by their empty local tensor."""
    flag = getattr(param, "use_muon", None)
    if flag is not None:
        return bool(flag)
    shape = getattr(param, "ds_shape", param.shape)  # zero.Init: the logical shape, not (0,)
    if len(shape) < 2 or id(param) in embeddings:
        return False
    return not any(key in name.lower() for key in _ADAM_NAMES)


def split_muon_groups(model: nn.Module, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each param group split into its Muon half and its AdamW half (DeepSpeed's order:
    Muon first; empty halves dropped), ``use_muon`` set on each. A group that already has
    ``use_muon`` is kept whole."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    out: list[dict[str, Any]] = []
    for group in groups:
        if "use_muon" in group or not group["params"]:
            out.append(group)
            continue
        flags = [uses_muon(names.get(id(p), ""), p, embeddings) for p in group["params"]]
        for use_muon in (True, False):
            half = [p for p, f in zip(group["params"], flags) if f is use_muon]
            if half:
                out.append({**group, "params": half, "use_muon": use_muon})
    return out


@dataclass(frozen=True)
class MatrixFragment:
    """Elements [start, start + length) of a parameter of ``shape`` (flattened), at
    ``local`` in this rank's master; ``bucket_offset``: the parameter's first element in
    the gathered bucket; ``split``: for a tensor-parallel shard, an object whose
    ``full(shard)`` gathers the whole matrix over the tensor group (a collective) and
    ``shard(full)`` cuts this rank's piece again
    (:class:`~shardspeed.parallel.tensor.full_matrix.TensorSplit`)."""

    local: int
    length: int
    start: int
    shape: tuple[int, ...]
    bucket_offset: int
    split: Any = None  # tensor parallel: rebuilds the full matrix (TensorSplit), else None


class Muon(Optimizer):
    """Muon for ``use_muon`` groups, AdamW for the others, with DeepSpeed's parameter names.

    Args:
        params: tensors or param groups; a group without ``use_muon`` is split by
            dimension (>= 2: Muon). Group keys override the arguments below.
        lr: learning rate of both halves (DeepSpeed: Muon 0.02, AdamW 3e-4 when unset).
        momentum: Muon's momentum ``beta``.
        weight_decay: decoupled weight decay of both halves.
        ns_method: ``"gram"`` (DeepSpeed's default) or ``"standard"``: same result.
        betas, eps: the AdamW half's (DeepSpeed's Muon defaults: (0.9, 0.95), 1e-10).
        muon_lr, adam_lr: per-half learning rates (override ``lr``).
        adam_w_mode: AdamW (decoupled decay) or Adam with L2 decay for the AdamW half.
        per_head_muon: DeepSpeed's per-attention-head orthogonalisation (not implemented).
        ns_steps: Newton-Schulz steps (5). nesterov: Nesterov momentum (True).
        ns_dtype: Newton-Schulz compute dtype, ``"fp32"``, ``"bf16"``, ``"fp16"`` or
            ``"auto"`` (DeepSpeed's: bf16 for standard, fp16 for gram on an accelerator;
            fp32 on the CPU).
    """

    elementwise = False

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | None = None,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        ns_method: str = "gram",
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-10,
        muon_lr: float | None = None,
        adam_lr: float | None = None,
        adam_w_mode: bool = True,
        per_head_muon: bool = False,
        ns_steps: int = 5,
        nesterov: bool = True,
        ns_dtype: str = "auto",
    ) -> None:
        if per_head_muon:
            raise ValueError(
                "Muon: per_head_muon=true (per-attention-head Newton-Schulz) is not "
                "implemented in ShardSpeed. Fix: remove optimizer.params.per_head_muon."
            )
        if ns_method not in NS_METHODS:
            raise ValueError(
                f"Muon: ns_method={ns_method!r} is invalid; use one of {list(NS_METHODS)}."
            )
        if ns_dtype not in NS_DTYPES:
            raise ValueError(
                f"Muon: ns_dtype={ns_dtype!r} is invalid; use one of {list(NS_DTYPES)}."
            )
        if not isinstance(ns_steps, int) or ns_steps < 1:
            raise ValueError(f"Muon: ns_steps={ns_steps!r} is invalid; use an integer >= 1 (5).")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon: momentum={momentum!r} is invalid; it must be in [0, 1).")
        for name, value in (("weight_decay", weight_decay), ("eps", eps)):
            check_non_negative("Muon", name, value)
        muon = {"lr": 0.02 if lr is None else lr, "momentum": momentum, "ns_method": ns_method}
        adam = {"lr": 3e-4 if lr is None else lr, "betas": check_betas("Muon", betas), "eps": eps}
        if muon_lr is not None:
            muon["lr"] = muon_lr
        if adam_lr is not None:
            adam["lr"] = adam_lr
        groups = _as_groups(params)
        for group in groups:
            for key, value in (
                (muon if group["use_muon"] else adam) | {"weight_decay": weight_decay}
            ).items():
                group.setdefault(key, value)
            check_non_negative("Muon", "lr", group["lr"])
        self.adam_w_mode = bool(adam_w_mode)
        self.ns_steps = ns_steps
        self.nesterov = bool(nesterov)
        self.ns_dtype = ns_dtype
        super().__init__(groups, {})
        self._layout: dict[int, list[list[MatrixFragment]]] = {}  # group -> per master
        self._gather_groups: dict[int, Any] = {}  # group -> ranks sharing its buckets
        self._comm_device: torch.device | None = None
        # sharded groups, per master: the owner exchange and the bucket's matrices
        self._plans: dict[int, list[tuple[ExchangePlan, list[BucketMatrix]]]] = {}

    def set_matrix_layout(
        self,
        layout: Sequence[Sequence[Sequence[tuple[Any, ...]]]],
        gather_groups: Sequence[Any],
        comm_device: torch.device | None = None,
    ) -> None:
        """Flat masters: ``layout[g][i]`` lists ``(local, length, start, shape,
        bucket_offset[, split])`` of every parameter fragment in master ``i`` of group ``g``
        (:class:`MatrixFragment`); ``gather_groups[g]``: the process group whose ranks
        hold the rest of group ``g``'s buckets (None when masters are whole buckets).
        ``comm_device``: where to gather and orthogonalise (the accelerator when the
        masters are offloaded to the host)."""
        self._layout = {
            g: [
                [MatrixFragment(o, n, s, tuple(shape), b, *x) for o, n, s, shape, b, *x in m]
                for m in per
            ]
            for g, per in enumerate(layout)
            if self.param_groups[g]["use_muon"]
        }
        self._gather_groups = dict(enumerate(gather_groups))
        self._comm_device = comm_device
        self._plans = {
            g: self._owner_plans(g, per, self._gather_groups[g])
            for g, per in self._layout.items()
            if self._gather_groups.get(g) is not None
        }
        if not any(g["use_muon"] for g in self.param_groups):
            warning_once(
                "Muon: no param group has use_muon=True, so every parameter trains with AdamW "
                "(groups built from flat 1-D buffers split by dimension all go to AdamW). Fix: "
                'use "optimizer": {"type": "Muon"} in the config, or pass a Muon instance '
                "built from the model's parameters (or groups with use_muon set).",
                __name__,
            )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One Muon / AdamW update of every parameter (a missing gradient counts as 0)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                if not group["use_muon"]:
                    self._adam(group, p, grad)
                    continue
                update = self._momentum_update(group, p, grad)
                if gi in self._layout:
                    update = self._orthogonalise_flat(gi, i, update)
                elif p.dim() >= 2:
                    method = group["ns_method"]
                    dtype = self._dtype(p, method)
                    update = orthogonalise(update, steps=self.ns_steps, method=method, dtype=dtype)
                else:
                    raise ValueError(
                        f"Muon: a {p.dim()}-D tensor of shape {tuple(p.shape)} is in a use_muon "
                        "group but no matrix layout was given (set_matrix_layout). Fix: put "
                        "tensors with fewer than 2 dimensions in a use_muon=False group."
                    )
                p.mul_(1.0 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
        return loss

    def _momentum_update(self, group: dict[str, Any], p: Tensor, grad: Tensor) -> Tensor:
        """Advance ``p``'s momentum; return the update to orthogonalise (elementwise)."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        momentum = state["momentum_buffer"]
        beta = group["momentum"]
        momentum.lerp_(grad, 1.0 - beta)
        return grad.lerp(momentum, beta) if self.nesterov else momentum.clone()

    def _owner_plans(
        self, gi: int, per_master: list[list[MatrixFragment]], group: Any
    ) -> list[tuple[ExchangePlan, list[BucketMatrix]]]:
        """Every bucket's matrices (from every rank's fragments: one collective, once) and
        this rank's owner exchange for each (:mod:`shardspeed.ops.muon_owners`)."""
        from shardspeed import comm

        world, rank = comm.get_world_size(group), comm.get_rank(group)
        mine = [
            sorted({(f.bucket_offset, _numel(f.shape), f.shape) for f in m}) for m in per_master
        ]
        every: list[Any] = [None] * world
        comm.all_gather_object(every, mine, group=group)
        loads = [0] * world
        plans = []
        for i, master in enumerate(self.param_groups[gi]["params"]):
            known = sorted({item for theirs in every for item in theirs[i]})
            for _, _, shape in known:  # refused on every rank (not only the owner)
                if len(shape) < 2:
                    raise ValueError(
                        f"Muon: a {len(shape)}-D parameter of shape {shape} is in a use_muon "
                        "group. Fix: set use_muon=False for tensors with fewer than 2 "
                        "dimensions."
                    )
            matrices = [BucketMatrix(offset, numel) for offset, numel, _ in known]
            owners = assign_owners(matrices, master.numel(), world, loads)
            plans.append((plan_exchange(matrices, owners, master.numel(), world, rank), matrices))
        return plans

    def tensor_gather_order(self) -> list[tuple[int, int, int]]:
        """``(group, master, bucket offset)`` of each tensor-parallel matrix this rank
        gathers over the tensor axis per step, in step order (the engine checks that the
        tensor ranks agree: each gather is a collective)."""
        order = []
        for gi, per in self._layout.items():
            for i, fragments in enumerate(per):
                if gi in self._plans:
                    plan, matrices = self._plans[gi][i]
                    offsets = [matrices[j].offset for j, _, _ in plan.owned]
                else:
                    offsets = [f.bucket_offset for f in fragments]
                split = {f.bucket_offset for f in fragments if f.split is not None}
                order += [(gi, i, b) for b in offsets if b in split]
        return order

    def _orthogonalise_flat(self, gi: int, i: int, update: Tensor) -> Tensor:
        """Whole-matrix Newton-Schulz for the matrices of master ``i`` of group ``gi``:
        this rank's slice of each orthogonalised matrix, zeros elsewhere (module doc)."""
        fragments = self._layout[gi][i]
        device = self._comm_device or update.device
        shard = update.to(device)
        method = self.param_groups[gi]["ns_method"]
        dtype = self._dtype(shard, method)
        by_offset = {f.bucket_offset: f for f in fragments}

        def whole(f: MatrixFragment, matrix: Tensor) -> Tensor:
            if len(f.shape) < 2:
                raise ValueError(
                    f"Muon: a {len(f.shape)}-D parameter of shape {f.shape} is in a use_muon "
                    "group. Fix: set use_muon=False for tensors with fewer than 2 dimensions."
                )
            if f.split is not None:  # a tensor-parallel shard: the whole matrix, then ours
                matrix = f.split.full(matrix)
            ortho = orthogonalise(matrix, steps=self.ns_steps, method=method, dtype=dtype)
            return f.split.shard(ortho) if f.split is not None else ortho

        if gi in self._plans:  # sharded: each matrix on its owner, two all-to-alls
            plan, matrices = self._plans[gi][i]

            def owned(j: int, flat: Tensor) -> Tensor:
                f = by_offset[matrices[j].offset]  # the owner holds a piece of it
                return whole(f, flat.view(f.shape)).reshape(-1)

            group = self._gather_groups[gi]
            return exchange(plan, shard, group, owned).to(update.device)
        out = torch.zeros_like(update)  # whole buckets (ZeRO 0): every matrix here
        for f in fragments:
            matrix = shard.narrow(0, f.bucket_offset, _numel(f.shape)).view(f.shape)
            piece = whole(f, matrix).reshape(-1).narrow(0, f.start, f.length)
            out.narrow(0, f.local, f.length).copy_(piece)
        return out

    def _dtype(self, t: Tensor, method: str) -> torch.dtype:
        """Newton-Schulz compute dtype: ``ns_dtype``, or DeepSpeed's choice by method."""
        chosen = NS_DTYPES[self.ns_dtype]
        if chosen is not None:
            return chosen
        if t.device.type == "cpu":
            return torch.float32
        return torch.float16 if method == "gram" else torch.bfloat16

    def _adam(self, group: dict[str, Any], p: Tensor, grad: Tensor) -> None:
        state = self.state[p]
        if "step" not in state:
            state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        state["step"] += 1
        step, (beta1, beta2) = state["step"], group["betas"]
        if not self.adam_w_mode and group["weight_decay"] != 0.0:
            grad = grad.add(p, alpha=group["weight_decay"])
        state["exp_avg"].lerp_(grad, 1.0 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        denom = (state["exp_avg_sq"] / (1.0 - beta2**step)).sqrt_().add_(group["eps"])
        if self.adam_w_mode:
            p.mul_(1.0 - group["lr"] * group["weight_decay"])
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1.0 - beta1**step))


def _as_groups(params: Iterable[Tensor] | Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Param groups with ``use_muon`` set: a group without it is split by dimension."""
    items = list(params)
    if not items:
        raise ValueError("Muon: got an empty parameter list.")
    groups = [dict(g) if isinstance(g, dict) else {"params": [g]} for g in items]
    if not isinstance(items[0], dict):
        groups = [{"params": [g["params"][0] for g in groups]}]
    out = []
    for group in groups:
        given = group["params"]
        tensors = [given] if isinstance(given, Tensor) else list(given)
        if "use_muon" in group:
            out.append({**group, "params": tensors})
            continue
        for use_muon in (True, False):
            half = [t for t in tensors if (t.dim() >= 2) is use_muon]
            if half:
                out.append({**group, "params": half, "use_muon": use_muon})
    return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n

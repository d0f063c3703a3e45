"""``safe_get_*`` / ``safe_set_*``: the fp32 state an engine keeps for one parameter.

At every ZeRO stage the engine keeps, per trainable parameter, an fp32 master, a reduced
gradient and the optimizer state in flat buffers, of which each rank holds a *fragment*
(stage 0: the whole parameter; stages 1-3: the elements of the flattened parameter that
fall into this rank's slice of its bucket or flat). ``shardspeed.initialize`` links every
trained parameter to its engine (:func:`link_engine`); these functions find the fragment
through that link.

* ``safe_get_full_*`` return the whole tensor in the parameter's shape, in fp32, on the
  engine's device. At stages 1-3 they are **collectives** (one all-reduce over the
  data-parallel group): every rank must call them, for the same parameters, in the same
  order.
* ``safe_get_local_*`` return this rank's fragment as a flat fp32 copy (possibly empty).
* ``safe_set_full_*`` take the whole tensor (every rank passes the same value) and write
  this rank's fragment; the fp32 setter also updates the parameter itself. No
  communication. ``safe_update_full_grad_vectorized(params, fn)`` sets each gradient to
  ``fn(full_grad, param)`` (a collective, as the getter it calls).
* ``safe_set_local_*`` take this rank's fragment (the shape ``safe_get_local_*`` returns).
  ``safe_set_local_fp32_param`` is a collective where parameters are replicated in full
  (stages 1-2, and stage-3 parameters that are gathered, e.g. persistent ones).

Gradients (DeepSpeed's semantics): the gradient is read after ``engine.backward()`` on the
accumulation-boundary micro-step and before ``engine.step()``; it is the gradient the step
will apply: averaged over data-parallel ranks, summed over the micro-steps of the window
(each scaled by 1/GAS), with the loss scale divided out, before clipping. ``step()`` zeroes
it. The gradient setters replace that gradient (the loss scale is applied for you; with
optimizer offload the host copy is refreshed). At stages 2-3 gradients are reduced every
micro-step, so earlier in the window the partial sum is returned (and a value set then is
accumulated onto by the rest of the window); at stages 0-1 they are reduced only at the
boundary, and reading or writing them earlier raises ``RuntimeError``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardspeed.zero.partition import FlatLayout, intersect

_LINK = "_ss_fragment_link"


@dataclass(frozen=True)
class LocalFragment:
    """Elements ``[start, start + length)`` of the flattened parameter, at ``offset`` in
    ``master`` and in ``grad`` (both aligned: one bucket slice / flat shard)."""

    start: int
    length: int
    master: torch.Tensor  # the fp32 tensor the optimizer keys its state by
    grad: torch.Tensor  # the reduced-gradient storage aligned with ``master``
    offset: int

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor[self.offset : self.offset + self.length]


def _fragment(layout: FlatLayout, rank: int, index: int) -> tuple[int, int, int, int]:
    """(param_start, length, bucket_index, offset in the rank's slice of that bucket)."""
    slot = layout.slots[index]
    bucket = layout.buckets[slot.bucket_index]
    owned = bucket.shard_range(rank)
    hit = intersect((slot.offset, slot.offset + slot.numel), owned)
    if hit is None:
        return 0, 0, slot.bucket_index, 0
    return hit[0] - slot.offset, hit[1] - hit[0], slot.bucket_index, hit[0] - owned[0]


class _Source:
    """One layout of a sharding group (a ``FlatGroup``, or one flat of a stage-3
    ``UnitGroup``, see :func:`shardspeed.zero.fragments.param_fragments`)."""

    def __init__(
        self, group: Any, layout: FlatLayout, rank: int, params: list, base: int, axis: Any
    ):
        self.group, self.layout, self.rank, self.params, self.base = (
            group, layout, rank, params, base,
        )  # fmt: skip
        self.axis_group = axis.group  # the ranks holding the other fragments
        self.sharded = layout.shard_world_size > 1

    def _master_index(self, index: int) -> int:
        return self.base + self.layout.slots[index].bucket_index

    def fragment(self, index: int) -> LocalFragment:
        start, length, _, offset = _fragment(self.layout, self.rank, index)
        m = self._master_index(index)
        grad = self.group.shard_grad(self.group.buckets[m])  # aligned with the master
        return LocalFragment(start, length, self.group.masters[m], grad, offset)

    def publish(self, index: int) -> None:
        self.group.copy_master_to_params(self._master_index(index))

    def restage_grad(self, index: int) -> None:
        """After a gradient fragment was written: refresh the host copy the optimizer reads
        under optimizer offload (a no-op without offload)."""
        self.group.stage_host_grad(self.group.buckets[self._master_index(index)])

    def has_full_copy(self, index: int) -> bool:
        """``param.data`` is the whole parameter now (stage 3: gathered, e.g. persistent)."""
        return self.group.is_gathered(self._master_index(index))


@dataclass(frozen=True)
class _Link:
    engine: weakref.ref
    source: _Source
    index: int


def link_engine(engine: Any) -> None:
    """Point every parameter ``engine`` trains at its flat storage (called by ``initialize``)."""
    ref = weakref.ref(engine)
    for group, axis in zip(engine.flat_groups, engine.shard_axes):
        for layout, rank, params, _, base in group.layouts():
            source = _Source(group, layout, rank, params, base, axis)
            for i, p in enumerate(params):
                setattr(p, _LINK, _Link(ref, source, i))


class _Handle:
    """One parameter, its engine and this rank's fragment."""

    def __init__(self, param: Any, what: str) -> None:
        link = getattr(param, _LINK, None) if isinstance(param, torch.Tensor) else None
        if link is None or link.source.params[link.index] is not param:
            shape = tuple(getattr(param, "ds_shape", getattr(param, "shape", ())))
            raise ValueError(
                f"{what}(param): the parameter (shape {shape}, requires_grad="
                f"{getattr(param, 'requires_grad', None)}) is not trained by a ShardSpeed engine. "
                "Pass a parameter of the model given to shardspeed.initialize(); frozen parameters "
                "and parameters left out of the optimizer have no fp32 master, gradient or "
                "optimizer state (read the parameter itself)."
            )
        engine = link.engine()
        if engine is None:
            raise ValueError(f"{what}(param): the engine that trained this parameter was deleted.")
        self.what = what
        self.param = param
        self.engine = engine
        self.source = link.source
        self.index = link.index
        self.fragment = link.source.fragment(link.index)
        self.shape = torch.Size(getattr(param, "ds_shape", param.shape))
        if self.fragment.master.numel() == 0:  # same on every rank: no collective is skipped
            raise ValueError(
                f"{what}(param): the fp32 master of this parameter is not in memory (swapped "
                "out to NVMe by offload_optimizer.device='nvme'); the safe_get/safe_set "
                "utilities support masters on the device or the host (offload device 'cpu')."
            )

    def assemble(self, local: torch.Tensor) -> torch.Tensor:
        """The full tensor from every rank's fragment (``local`` is this rank's, flat)."""
        out = torch.zeros(self.shape.numel(), dtype=torch.float32, device=self.engine.device)
        f = self.fragment
        out[f.start : f.start + f.length].copy_(local)
        if self.source.sharded:  # fragments are disjoint: their sum is the whole tensor
            from shardspeed import comm

            comm.all_reduce(out, group=self.source.axis_group)
        return out.view(self.shape)

    def full_value(self, value: Any) -> torch.Tensor:
        """``value`` checked against the parameter's shape, flattened."""
        value = torch.as_tensor(value)
        if value.numel() != self.shape.numel():
            raise ValueError(
                f"{self.what}(param, value): value has shape {tuple(value.shape)} but the "
                f"parameter has shape {tuple(self.shape)}; pass the full tensor."
            )
        f = self.fragment
        return value.reshape(-1)[f.start : f.start + f.length]

    def local_value(self, value: Any) -> torch.Tensor:
        value = torch.as_tensor(value)
        if value.numel() != self.fragment.length:
            raise ValueError(
                f"{self.what}(param, value): this rank holds {self.fragment.length} elements of "
                f"the parameter, value has {value.numel()}; pass what the matching "
                "safe_get_local_* returns."
            )
        return value.reshape(-1)

    def grad_storage(self) -> tuple[torch.Tensor, float]:
        """This rank's reduced gradient fragment (a view of the storage the step reads, loss
        scale still in) and the loss scale; refuses before this micro-step is reduced."""
        reducer = self.engine.reducer
        if getattr(reducer, "dirty", False):
            raise RuntimeError(
                f"{self.what}(param): this micro-step's gradients are not reduced yet. Call it "
                "after engine.backward(loss) (not loss.backward()) and before engine.step(); at "
                f"ZeRO stage {self.engine.stage} gradients are reduced "
                + (
                    "only on the accumulation-boundary micro-step."
                    if self.engine.stage <= 1
                    else "at the end of every engine.backward()."
                )
            )
        return self.fragment.view(self.fragment.grad), float(self.engine.loss_scaler.loss_scale)

    def grad(self) -> torch.Tensor:
        """This rank's reduced gradient fragment, fp32, loss scale divided out."""
        storage, scale = self.grad_storage()
        grad = storage.float()
        return grad / scale if scale != 1.0 else grad

    def set_grad(self, local: torch.Tensor) -> None:
        """Write this rank's gradient fragment (fp32 values, loss scale not applied)."""
        storage, scale = self.grad_storage()
        local = local.to(device=storage.device, dtype=torch.float32)
        storage.copy_(local * scale if scale != 1.0 else local)
        self.source.restage_grad(self.index)

    def state(self, key: str) -> torch.Tensor:
        """This rank's fragment of optimizer state ``key`` (a view)."""
        optimizer = getattr(self.engine, "basic_optimizer", None)
        if optimizer is None:
            raise ValueError(
                f"{self.what}(param, {key!r}): the engine has no optimizer; pass one to "
                "shardspeed.initialize() or add an 'optimizer' block to the config."
            )
        master = self.fragment.master
        state = optimizer.state.get(master, {})
        value = state.get(key)
        if not isinstance(value, torch.Tensor) or value.numel() != master.numel():
            tensors = sorted(
                k
                for k, v in state.items()
                if isinstance(v, torch.Tensor) and v.numel() == master.numel()
            )
            raise ValueError(
                f"{self.what}(param, optim_state_key={key!r}): no elementwise optimizer state "
                f"{key!r} for this parameter; available: {tensors}. "
                f"({type(optimizer).__name__} creates its state at the first step().)"
            )
        return self.fragment.view(value)

    def refresh_param(self, full: torch.Tensor | None) -> None:
        """After the masters changed: update the parameter's own storage (``full`` if known)."""
        self.source.publish(self.index)
        if self.source.has_full_copy(self.index):
            if full is None:
                full = self.assemble(self.fragment.view(self.fragment.master))
            with torch.no_grad():
                self.param.data.copy_(full.reshape(self.param.data.shape))


# -- full (collective at stages 1-3) ----------------------------------------------------------
def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor:
    """The full fp32 master of ``param`` in its shape (a collective at stages 1-3)."""
    h = _Handle(param, "safe_get_full_fp32_param")
    return h.assemble(h.fragment.view(h.fragment.master))


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor:
    """The full fp32 reduced gradient of ``param`` (a collective at stages 1-3).

    Valid after ``engine.backward()`` on the accumulation boundary and before ``step()``
    (see the module docstring); the loss scale is divided out.
    """
    h = _Handle(param, "safe_get_full_grad")
    return h.assemble(h.grad())


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor:
    """The full fp32 optimizer state ``optim_state_key`` (e.g. ``"exp_avg"``) of ``param``."""
    h = _Handle(param, "safe_get_full_optimizer_state")
    return h.assemble(h.state(optim_state_key))


@torch.no_grad()
def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the fp32 master (and the parameter) of ``param`` to ``value`` (same on every rank)."""
    h = _Handle(param, "safe_set_full_fp32_param")
    local = h.full_value(value)
    h.fragment.view(h.fragment.master).copy_(local)
    h.refresh_param(torch.as_tensor(value))


@torch.no_grad()
def safe_set_full_optimizer_state(
    param: torch.Tensor, value: torch.Tensor, optim_state_key: str
) -> None:
    """Set optimizer state ``optim_state_key`` of ``param`` to ``value`` (same on every rank)."""
    h = _Handle(param, "safe_set_full_optimizer_state")
    h.state(optim_state_key).copy_(h.full_value(value))


@torch.no_grad()
def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace the reduced gradient of ``param`` with ``value`` (the full tensor, same on
    every rank; loss scale not applied): the next ``step()`` applies it. No communication.

    Valid where :func:`safe_get_full_grad` is: after ``engine.backward()`` on the
    accumulation boundary and before ``step()``.
    """
    h = _Handle(param, "safe_set_full_grad")
    h.set_grad(h.full_value(value))


@torch.no_grad()
def safe_update_full_grad_vectorized(
    param_list: list[torch.Tensor],
    update_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> None:
    """Replace the reduced gradient of every parameter ``p`` in ``param_list`` with
    ``update_func(full_grad, p)`` (``full_grad`` as :func:`safe_get_full_grad` returns it).

    A collective at stages 1-3 (one gradient all-reduce per parameter, in list order):
    every rank passes the same list. Frozen parameters (``requires_grad=False``) are
    skipped, as in DeepSpeed.
    """
    for param in param_list:
        if not param.requires_grad:
            continue
        h = _Handle(param, "safe_update_full_grad_vectorized")
        new = update_func(h.assemble(h.grad()), param)
        h.set_grad(h.full_value(new))


# -- local (this rank's fragment) -------------------------------------------------------------
def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor:
    """This rank's fragment of the fp32 master of ``param`` (flat fp32 copy, maybe empty)."""
    h = _Handle(param, "safe_get_local_fp32_param")
    return h.fragment.view(h.fragment.master).float().clone()


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor:
    """This rank's fragment of the reduced fp32 gradient of ``param`` (flat copy)."""
    h = _Handle(param, "safe_get_local_grad")
    return h.grad().clone()


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor:
    """This rank's fragment of optimizer state ``optim_state_key`` of ``param`` (flat copy)."""
    h = _Handle(param, "safe_get_local_optimizer_state")
    return h.state(optim_state_key).float().clone()


@torch.no_grad()
def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace this rank's fragment of the reduced gradient of ``param`` (the shape
    :func:`safe_get_local_grad` returns; loss scale not applied). No communication."""
    h = _Handle(param, "safe_set_local_grad")
    h.set_grad(h.local_value(value))


@torch.no_grad()
def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's fragment of the fp32 master of ``param`` and update the parameter.

    A collective where the parameter is replicated in full (stages 1-2, gathered stage-3
    parameters): every rank calls it with its own fragment.
    """
    h = _Handle(param, "safe_set_local_fp32_param")
    h.fragment.view(h.fragment.master).copy_(h.local_value(value))
    h.refresh_param(None)


@torch.no_grad()
def safe_set_local_optimizer_state(
    param: torch.Tensor, value: torch.Tensor, optim_state_key: str
) -> None:
    """Set this rank's fragment of optimizer state ``optim_state_key`` of ``param``."""
    h = _Handle(param, "safe_set_local_optimizer_state")
    h.state(optim_state_key).copy_(h.local_value(value))


__all__ = [
    "link_engine",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
]

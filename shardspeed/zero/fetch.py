"""ZeRO-3 units and the coordinator that gathers them around use and releases them after.

A *unit* is a module whose sharded parameters (its :class:`~shardspeed.zero.flat_buffer.FlatGroup`
of each param group) are gathered and released together. The :class:`FetchCoordinator`
installs the forward hooks that gather a unit before its forward (prefetching the next
unit of the previous forward's order) and its backward, and release it after; the
:class:`~shardspeed.zero.order_check.OrderCheck` runs before every gather.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from shardspeed import comm
from shardspeed.zero.order_check import OrderCheck
from shardspeed.zero.params import ZeroParamStatus

if TYPE_CHECKING:
    from shardspeed.zero.flat_buffer import FlatGroup


class Unit:
    """A module whose sharded parameters are gathered and released together."""

    def __init__(self, unit_id: int, name: str, module: nn.Module, is_root: bool) -> None:
        self.id = unit_id
        self.name = name or "<root>"
        self.module = module
        self.is_root = is_root
        self.flats: list[FlatGroup] = []

    @property
    def numel(self) -> int:
        return sum(f.numel for f in self.flats)

    def available(self) -> bool:
        return all(f.status is ZeroParamStatus.AVAILABLE for f in self.flats)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class FetchCoordinator:
    """Forward/backward hooks that gather units before use and release them after.

    * root unit: gathered by the model's forward pre-hook, kept through backward
      (tied weights such as ``wte``/``lm_head`` live there), released after the reduction;
    * other units: gathered by their forward pre-hook (prefetching the next unit of the
      previous forward's order), released by their forward post-hook; gathered again when
      the gradient of their output arrives, released once their gradients are complete.
    """

    def __init__(
        self,
        units: list[Unit],
        check: OrderCheck,
        prefetch_numel: int,
        max_live_numel: int = 0,
        max_reuse_distance: int = 0,
    ) -> None:
        self.units = units
        self.root = units[0]
        self.check = check
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_distance = max_reuse_distance
        self.kept: set[int] = set()  # units kept gathered from their forward to their backward
        self.prev_order: list[int] = []
        self.order: list[int] = []
        self.prefetch_ok = True
        self.paused = False  # the hybrid engine gathered everything: hooks stand aside
        # FSDP2's reshard_after_forward for a pipeline stage, whose gradients are reduced
        # only at the end of the batch: release a unit after its forward (never kept for
        # backward) and after its backward, once every parameter's gradient accumulated
        self.reshard_after_forward = False
        self._grads_in: dict[int, set[int]] = {}
        self._handles: list[object] = []

    def install(self) -> None:
        root = self.root.module
        self._handles.append(root.register_forward_pre_hook(self._root_pre))
        self._handles.append(root.register_forward_hook(self._root_post))
        for unit in self.units[1:]:
            if not unit.flats:
                continue
            self._handles.append(unit.module.register_forward_pre_hook(self._make_pre(unit)))
            self._handles.append(unit.module.register_forward_hook(self._make_post(unit)))
            for flat in unit.flats:
                for p in flat.params:
                    if p.requires_grad:
                        hook = self._make_grad_in(unit)
                        self._handles.append(p.register_post_accumulate_grad_hook(hook))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()  # type: ignore[attr-defined]
        self._handles = []

    # -- primitives -----------------------------------------------------------------------
    def fetch(self, unit: Unit, what: str = "gather") -> None:
        if unit.available():
            return
        if all(f.status is ZeroParamStatus.NOT_AVAILABLE for f in unit.flats):
            with comm.set_current_tag(f"zero3.{what} unit {unit.name}"):
                self.check(unit.id + 1, f"{what} unit {unit.name}")
                for f in unit.flats:
                    f.start_gather()
        for f in unit.flats:
            f.wait_gather()

    def prefetch(self, unit: Unit) -> None:
        if not unit.flats or unit.numel > self.prefetch_numel:
            return
        if any(f.status is not ZeroParamStatus.NOT_AVAILABLE for f in unit.flats):
            return
        with comm.set_current_tag(f"zero3.prefetch unit {unit.name}"):
            self.check(unit.id + 1, f"prefetch unit {unit.name}")
            for f in unit.flats:
                f.start_gather()

    def release(self, unit: Unit) -> None:
        self.kept.discard(unit.id)
        for f in unit.flats:
            if not f.persistent:
                f.release()

    def release_all(self, include_root: bool = True) -> None:
        for unit in self.units:
            if include_root or not unit.is_root:
                self.release(unit)

    def live_numel(self) -> int:
        """Elements of sharded (non-persistent) units gathered or being gathered right now."""
        return sum(
            f.numel
            for u in self.units
            for f in u.flats
            if not f.persistent and f.status is not ZeroParamStatus.NOT_AVAILABLE
        )

    def _make_grad_in(self, unit: Unit):  # noqa: ANN202 - hook closure
        trainable = sum(p.requires_grad for f in unit.flats for p in f.params)

        def hook(param: nn.Parameter) -> None:
            if not self.reshard_after_forward or self.paused:
                return
            seen = self._grads_in.setdefault(unit.id, set())
            seen.add(id(param))
            if len(seen) == trainable:  # the unit's backward is over for this micro-batch
                self._grads_in.pop(unit.id)
                self.release(unit)

        return hook

    def keep_for_backward(self, unit: Unit) -> bool:
        """Keep ``unit`` gathered from its forward to its backward instead of re-gathering?

        ``stage3_max_reuse_distance``: the unit is reused (by its backward) after the units
        that run after it in the recorded forward order; when their parameter elements add
        up to at most the distance, releasing it would only mean gathering it again soon.
        ``stage3_max_live_parameters`` caps the gathered elements kept alive this way,
        counting the next unit of the order, which is about to be gathered. Decided from
        the previous forward's order, which every rank shares; on a changed order (or no
        recorded order yet) units are released.
        """
        pos = len(self.order) - 1
        prev = self.prev_order
        if (
            self.reshard_after_forward
            or not self.prefetch_ok
            or pos < 0
            or pos >= len(prev)
            or prev[pos] != unit.id
        ):
            return False
        later = prev[pos + 1 :]
        if sum(self.units[u].numel for u in set(later) if u != unit.id) > self.max_reuse_distance:
            return False
        upcoming = 0
        if later and not self.units[later[0]].available():
            upcoming = self.units[later[0]].numel
        return self.live_numel() + upcoming <= self.max_live_numel

    # -- hooks ------------------------------------------------------------------------------
    def _root_pre(self, module: nn.Module, args: object) -> None:
        if self.paused:
            return
        if not _in_backward():
            self.order = []
            self.prefetch_ok = True
        self.fetch(self.root)
        if not _in_backward() and self.prev_order:
            self.prefetch(self.units[self.prev_order[0]])

    def _root_post(self, module: nn.Module, args: object, output: object) -> None:
        if self.paused:
            return
        if not _in_backward():
            self.prev_order = self.order
        grad = torch.is_grad_enabled()
        for unit in self.units:  # e.g. a prefetched unit this forward did not use
            if (not unit.is_root or not grad) and not (grad and unit.id in self.kept):
                self.release(unit)

    def _make_pre(self, unit: Unit):  # noqa: ANN202 - hook closure
        def hook(module: nn.Module, args: object) -> None:
            if self.paused:
                return
            if _in_backward():  # e.g. activation-checkpoint recomputation
                self.fetch(unit, "gather (recompute)")
                return
            pos = len(self.order)
            self.order.append(unit.id)
            prev = self.prev_order
            if self.prefetch_ok and prev and (pos >= len(prev) or prev[pos] != unit.id):
                from shardspeed.utils.logging import warning_once

                warning_once(
                    "ZeRO-3: module execution order changed between forward passes; prefetch "
                    "falls back to on-demand gathering for the rest of this forward."
                )
                self.prefetch_ok = False
            self.fetch(unit)
            if self.prefetch_ok and pos + 1 < len(prev):
                self.prefetch(self.units[prev[pos + 1]])

        return hook

    def _pre_backward(self, unit: Unit, before: Unit | None) -> None:
        self._grads_in.pop(unit.id, None)  # count this backward's gradients afresh
        self.fetch(unit, "gather for backward")
        if before is not None and not before.is_root:
            self.prefetch(before)

    def _make_post(self, unit: Unit):  # noqa: ANN202 - hook closure
        def hook(module: nn.Module, args: object, output: object) -> None:
            if self.paused:
                return
            if torch.is_grad_enabled():
                leaves = torch.utils._pytree.tree_leaves(output)
                tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
                if tensors:
                    # the unit that ran just before this one is the next to need its params
                    before = None
                    order = self.order
                    if not _in_backward() and self.prefetch_ok and len(order) > 1:
                        if order[-1] == unit.id:
                            before = self.units[order[-2]]
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, lambda _grad: self._pre_backward(unit, before), mode="any"
                    )
            if _in_backward():  # a recomputation's backward still needs the params
                return
            if torch.is_grad_enabled() and self.keep_for_backward(unit):
                self.kept.add(unit.id)
                return
            self.release(unit)

        return hook

"""Where a pipeline stage's ZeRO-3 parameters live during a batch.

A pipeline batch runs ``m`` forward and ``m`` backward passes of the same layers. At
ZeRO-3 each unit's parameters are gathered from their shards around use, so the stage
chooses between two residencies (the knob is ``pipeline.reshard_after_forward``, named
after FSDP2's argument that makes the same choice):

* ``False`` (default, as torchtitan does under pipeline parallelism): every unit of the
  stage is gathered **once per batch**, before the first micro-batch, kept through all
  ``m`` forwards and backwards, and released when the batch's gradients are reduced. One
  all-gather per unit per batch; it costs the whole stage's parameters in the parameter
  dtype on every rank while the batch runs (reported by :func:`residency_cost`).
* ``True``: the per-unit hooks gather a unit for its forward and release it after, and
  gather it again for its backward (the coordinator keeps it until the next forward
  needs it when nothing else does). About one all-gather per unit per micro-batch; only
  the units in use (plus the prefetched one) are whole at any time.

Gradients are the same either way: they accumulate in ``param.grad`` over the batch and
are reduce-scattered once, at the end (:meth:`PipelineEngine._reduce_grads`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shardspeed import comm


@dataclass(frozen=True)
class ResidencyCost:
    """Bytes of gathered parameters a ZeRO-3 stage holds while a batch runs."""

    keep_bytes: int  # whole stage gathered (reshard_after_forward=False)
    reshard_bytes: int  # largest unit + the one prefetched after it (reshard_after_forward=True)

    def describe(self, reshard_after_forward: bool) -> str:
        chosen = self.reshard_bytes if reshard_after_forward else self.keep_bytes
        other = self.keep_bytes if reshard_after_forward else self.reshard_bytes
        return (
            f"ZeRO-3 stage parameters {'resharded after each pass' if reshard_after_forward else 'kept gathered across the batch'}: "
            f"up to {chosen / 2**20:.2f} MiB gathered per rank during a batch "
            f"({other / 2**20:.2f} MiB with reshard_after_forward={not reshard_after_forward})"
        )


def residency_cost(sharding: Any) -> ResidencyCost:
    """Gathered bytes each residency costs for a stage-3 ``UnitSharding``."""
    per_unit = []
    for unit in sharding.units:
        flats = [f for f in unit.flats if not f.persistent]
        per_unit.append(sum(f.numel * f.param_dtype.itemsize for f in flats))
    ranked = sorted(per_unit, reverse=True)
    return ResidencyCost(keep_bytes=sum(per_unit), reshard_bytes=sum(ranked[:2]))


@contextlib.contextmanager
def batch_residency(sharding: Any, keep_gathered: bool) -> Iterator[None]:
    """Run a pipeline batch with the stage's units gathered once (``keep_gathered``) or
    under the ordinary per-unit hooks. The reduction at the end of the batch releases
    every unit (``after_flush``); leaving the block resumes the hooks."""
    coordinator = getattr(sharding, "coordinator", None)
    if not keep_gathered or coordinator is None:
        yield
        return
    units = [u for u in sharding.units if u.flats and not u.available()]
    with comm.set_current_tag("zero3.gather stage for the batch"):
        for unit in units:  # launch every gather, then wait: they overlap each other
            coordinator.check(unit.id + 1, f"gather unit {unit.name} for the batch")
            for flat in unit.flats:
                flat.start_gather()
        for unit in units:
            for flat in unit.flats:
                flat.wait_gather()
    coordinator.paused = True  # every unit is whole: the per-unit hooks stand aside
    try:
        yield
    finally:
        coordinator.paused = False
        coordinator.release_all()

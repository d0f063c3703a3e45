"""qwZ and hpZ: how a stage-3 flat's full parameter buffer is gathered.

A :class:`~shardspeed.zero.residency.GatheredResidency` with ZeRO++ on hands its gathers
to one :class:`WeightGathers` per flat. Three ways to fill the full buffer
``(world * shard_numel,)``:

* **plain** (qwZ off, no usable secondary partition): all-gather the fp shards;
* **quantized** (qwZ, ``zero_quantized_weights``): each rank quantizes its fp shard to
  int8 in blocks of :data:`~shardspeed.zero.zeropp.quantize.WEIGHT_BLOCK` with one fp32
  scale per block; codes and scales are all-gathered (two collectives) and dequantized
  on arrival into the full buffer. The fp shard (and the masters) are never touched:
  only the gathered copy is lossy. Forward and backward gathers are both quantized, as
  in DeepSpeed; quantizing the same shard twice gives the same values, so forward and
  backward see identical weights.
* **secondary** (hpZ, ``zero_hpz_partition_size`` = P > 1; backward only): after a
  primary gather, each rank keeps 1/P of the gathered flat, the rows of the P-th of the
  data group its hpZ group index names, as received (int8 codes and scales under qwZ,
  fp values otherwise). The backward gather then all-gathers those rows within the hpZ
  group only (the node), never across nodes::

      world 4, hpZ groups [0 1] [2 3]; the flat is 4 shard rows s0 s1 s2 s3
      after the forward gather: ranks 0, 2 keep rows s0 s1; ranks 1, 3 keep s2 s3
      backward gather on rank 2: all-gather over [2 3] of (s0 s1) and (s2 s3)

  The secondary copy is refreshed by every primary gather (no extra communication: it is
  a slice of what just arrived) and dropped whenever the shard changes (a step, a load),
  so a backward gather without a valid copy falls back to the primary gather. With qwZ
  the rows are kept quantized (1 byte per element) and the backward weights equal the
  forward ones bit for bit; without qwZ hpZ is exact.

Only *compute* gathers (the ones the ZeRO-3 fetch coordinator issues around a unit's
forward and backward, marked by :func:`compute_gathers`) are quantized or served from the
secondary copy. Every other gather (``GatheredParameters``, state-dict reads and writes,
checkpoint export) is a plain fp all-gather, so what a user reads or writes back is exact,
as with DeepSpeed, whose ``GatheredParameters`` never quantizes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from shardspeed import comm
from shardspeed.zero.fetch import FetchCoordinator, Unit
from shardspeed.zero.zeropp.quantize import WEIGHT_BLOCK, Quantized, dequantize_rows, quantize_rows


def in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


_COMPUTE = threading.local()


@contextlib.contextmanager
def compute_gathers() -> Iterator[None]:
    """Mark the gathers started inside as compute gathers (the fetch coordinator's)."""
    depth = getattr(_COMPUTE, "depth", 0)
    _COMPUTE.depth = depth + 1
    try:
        yield
    finally:
        _COMPUTE.depth = depth


def in_compute_gather() -> bool:
    return getattr(_COMPUTE, "depth", 0) > 0


@dataclass
class PendingGather:
    """A launched gather: :meth:`WeightGathers.finish` waits and returns the full buffer."""

    works: list[Any]
    full: torch.Tensor | None  # plain / secondary fp: the output buffer itself
    quantized: Quantized | None  # quantized: (world, ...) codes and scales
    refresh: bool  # a compute gather over the data group: refreshes the secondary copy
    keep_alive: Any = None


@dataclass(frozen=True)
class HpzGroup:
    """The hpZ group of this rank: ``size`` consecutive data ranks, this one at ``rank``."""

    group: Any
    size: int
    rank: int


class WeightGathers:
    """The gathers of one stage-3 flat with qwZ and/or hpZ (see the module docstring)."""

    def __init__(
        self,
        *,
        world: int,
        dp_group: Any,
        quantized: bool,
        hpz: HpzGroup | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.world = world
        self.dp_group = dp_group
        self.quantized = quantized
        self.hpz = hpz if hpz is not None and hpz.size > 1 else None
        self.dtype = dtype
        self.device = device
        # hpZ: this rank's rows of the last primary gather (codes+scales, or fp values)
        self.secondary: Quantized | torch.Tensor | None = None
        self.num_secondary_gathers = 0  # backward gathers served by the secondary copy
        # largest bound on |gathered - fp| of any weight since the last reset: half the
        # largest block scale that arrived (qwZ; 0 without quantization)
        self.max_error_bound = 0.0

    def drop_secondary(self) -> None:
        """The shard changed (a step or a load): the secondary copy is stale."""
        self.secondary = None

    def secondary_bytes(self) -> int:
        s = self.secondary
        if s is None:
            return 0
        return s.nbytes() if isinstance(s, Quantized) else s.numel() * s.element_size()

    # -- launch ---------------------------------------------------------------------------
    def start(self, source: Callable[[], torch.Tensor], numel: int) -> PendingGather:
        """Launch the gather of the ``numel``-element full buffer; ``source()`` gives this
        rank's fp shard (read only when the primary gather runs)."""
        compute = in_compute_gather()
        if compute and self.hpz is not None and self.secondary is not None and in_backward():
            self.num_secondary_gathers += 1
            return self._start_secondary(numel)
        src = source()  # (shard_numel,)
        if compute and self.quantized:
            q = quantize_rows(src.view(1, -1), 8, WEIGHT_BLOCK)
            out = Quantized(
                torch.empty(self.world, q.codes.shape[1], dtype=q.codes.dtype, device=self.device),
                torch.empty(self.world, q.scales.shape[1], dtype=torch.float32, device=self.device),
                q.numel, q.bits, q.block,
            )  # fmt: skip
            works = [
                comm.all_gather_into_tensor(out.codes, q.codes, group=self.dp_group, async_op=True),
                comm.all_gather_into_tensor(out.scales, q.scales, group=self.dp_group, async_op=True),
            ]  # fmt: skip
            return PendingGather(works, None, out, refresh=True, keep_alive=(q, src))
        full = torch.empty(numel, dtype=self.dtype, device=self.device)
        work = comm.all_gather_into_tensor(full, src, group=self.dp_group, async_op=True)
        # an exact gather refreshes the fp secondary copy (qwZ keeps codes: only its own)
        refresh = compute and not self.quantized
        return PendingGather([work], full, None, refresh=refresh, keep_alive=src)

    def _start_secondary(self, numel: int) -> PendingGather:
        hpz = self.hpz
        assert hpz is not None
        sec = self.secondary
        if isinstance(sec, Quantized):
            out = Quantized(
                torch.empty(self.world, sec.codes.shape[1], dtype=sec.codes.dtype, device=self.device),
                torch.empty(self.world, sec.scales.shape[1], dtype=torch.float32, device=self.device),
                sec.numel, sec.bits, sec.block,
            )  # fmt: skip
            works = [
                comm.all_gather_into_tensor(out.codes, sec.codes, group=hpz.group, async_op=True),
                comm.all_gather_into_tensor(out.scales, sec.scales, group=hpz.group, async_op=True),
            ]  # fmt: skip
            return PendingGather(works, None, out, refresh=False)
        assert sec is not None
        full = torch.empty(numel, dtype=self.dtype, device=self.device)
        work = comm.all_gather_into_tensor(full, sec, group=hpz.group, async_op=True)
        return PendingGather([work], full, None, refresh=False)

    # -- completion -----------------------------------------------------------------------
    def finish(self, pending: PendingGather) -> torch.Tensor:
        """Wait for ``pending``; return the full buffer ``(numel,)`` in the param dtype."""
        for work in pending.works:
            if work is not None:
                work.wait()
        q = pending.quantized
        if q is not None:
            full = dequantize_rows(q, self.dtype).reshape(-1)  # (world * shard_numel,)
            self.max_error_bound = max(self.max_error_bound, float(q.scales.max()) / 2)
        else:
            assert pending.full is not None
            full = pending.full
        if pending.refresh and self.hpz is not None:
            self._keep_secondary(full, q)
        return full

    def _keep_secondary(self, full: torch.Tensor, q: Quantized | None) -> None:
        hpz = self.hpz
        assert hpz is not None
        rows = self.world // hpz.size  # shard rows per hpZ member
        lo, hi = hpz.rank * rows, (hpz.rank + 1) * rows
        if q is not None:
            self.secondary = Quantized(
                q.codes[lo:hi].clone(), q.scales[lo:hi].clone(), q.numel, q.bits, q.block
            )
        else:
            self.secondary = full.view(self.world, -1)[lo:hi].reshape(-1).clone()


class ComputeGatherCoordinator(FetchCoordinator):
    """The ZeRO-3 fetch coordinator whose gathers are compute gathers (quantized under
    qwZ, served from the secondary copy under hpZ)."""

    def fetch(self, unit: Unit, what: str = "gather") -> None:
        with compute_gathers():
            super().fetch(unit, what)

    def prefetch(self, unit: Unit) -> None:
        with compute_gathers():
            super().prefetch(unit)

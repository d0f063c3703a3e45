"""ZeRO-Infinity optimizer offload: fp32 masters and optimizer state swapped to NVMe files.

Each master shard (one per flat / bucket) is a tensor the torch optimizer holds as a
parameter; while swapped out its ``.data`` is an empty placeholder, and so is every
optimizer-state tensor of its shape (Adam's ``exp_avg``/``exp_avg_sq``; scalar state
such as ``step`` stays in memory). :meth:`OptimizerSwapper.step` updates one master at a
time, because torch optimizers skip parameters whose ``.grad`` is None and keep their
state per tensor (the result is the same as one step over all of them):

1. swap in master k (its reads may already be in flight: see 2);
2. start reading master k+1 into free pool buffers, if enough are free (prefetch);
3. wait for k's reads, point ``master.data`` and its state at the pool buffers;
4. set ``master.grad``, run ``optimizer.step()``, write the master into its parameter
   shard (``write_back``);
5. start writing master + state back; their buffers return to the pool when the writes
   finish, while the next master steps.

Buffers: ``buffer_count`` host buffers of the largest master's size; one master needs
``1 + number of state tensors`` of them (3 for Adam), two masters' worth to overlap.
On the very first step the state does not exist yet: the optimizer allocates it, it is
written out and dropped. Checkpoints read and write through :meth:`resident`.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardspeed.config.base import explain
from shardspeed.utils.logging import log_dist
from shardspeed.zero.offload.buffer_pool import BufferPool
from shardspeed.zero.offload.file_io import AsyncFileIO, IOHandle
from shardspeed.zero.offload.policy import SwapSettings
from shardspeed.zero.offload.swap_dir import SwapDir

MASTER = "master"
# Adam-like optimizers keep two fp32 tensors per master: the up-front disk-space check
# reserves room for that many (a full disk later still raises the same error).
EXPECTED_STATE_TENSORS = 2


def _empty(dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype)


def _elt(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class _Slot:
    """One master shard and its swap files."""

    index: int
    master: torch.Tensor
    numel: int
    dtype: torch.dtype
    # swapped tensors: MASTER plus the optimizer-state keys seen so far -> dtype
    kinds: dict[str, torch.dtype] = field(default_factory=dict)
    writes: list[IOHandle] = field(default_factory=list)  # write-backs in flight
    reads: list[IOHandle] = field(default_factory=list)  # swap-in reads in flight
    buffers: dict[str, int] = field(default_factory=dict)  # kind -> pool buffer while in
    resident: bool = False

    @property
    def state_kinds(self) -> list[str]:
        return [k for k in self.kinds if k != MASTER]


class OptimizerSwapper:
    """Keeps masters + optimizer state in swap files; steps them one at a time."""

    def __init__(self, settings: SwapSettings, swap_dir: SwapDir, io: AsyncFileIO) -> None:
        self.settings = settings
        self.dir = swap_dir
        self.io = io
        self.slots: list[_Slot] = []
        self._by_id: dict[int, _Slot] = {}
        self._pool: BufferPool | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._write_backs: list[Callable[[], None]] = []
        self._order: list[_Slot] = []

    # -- set-up -------------------------------------------------------------------------
    def register(self, master: torch.Tensor) -> None:
        """Write a new master (contiguous host tensor) to its file and swap it out."""
        slot = _Slot(len(self.slots), master, master.numel(), master.dtype, {MASTER: master.dtype})
        path = self._path(slot, MASTER)
        self.io.reserve(path, master.numel() * master.element_size())
        self.io.write(master, path).wait()
        master.data = _empty(master.dtype)
        self.slots.append(slot)
        self._by_id[id(master)] = slot

    def attach(
        self,
        optimizer: torch.optim.Optimizer,
        masters: list[torch.Tensor],
        write_backs: list[Callable[[], None]],
    ) -> None:
        """The optimizer over the registered masters; ``write_backs[i]`` copies
        ``masters[i]`` (while it is swapped in) into its parameter shard."""
        self.optimizer = optimizer
        self._order = [self._slot(m) for m in masters]
        self._write_backs = [write_backs[i] for i in range(len(masters))]
        if len(self._order) != len(self.slots):
            raise AssertionError("every registered master must be stepped by the optimizer")
        log_dist(
            f"NVMe optimizer offload: {len(self.slots)} master shards, "
            f"{self.settings.buffer_count} buffers, swap dir {self.dir.path}"
        )

    def _slot(self, master: torch.Tensor) -> _Slot:
        slot = self._by_id.get(id(master))
        if slot is None:
            raise AssertionError("tensor is not a master registered with the NVMe swapper")
        return slot

    def _path(self, slot: _Slot, kind: str) -> Path:
        return self.dir.file(f"m{slot.index}.{re.sub(r'[^A-Za-z0-9_]', '_', kind)}.swp")

    @property
    def pool(self) -> BufferPool:
        if self._pool is None:
            largest = max(s.numel * max(_elt(d) for d in s.kinds.values()) for s in self.slots)
            self._pool = BufferPool(
                self.settings.buffer_count, max(largest, 1), self.settings.pin_memory
            )
        return self._pool

    # -- swap in / out -------------------------------------------------------------------
    def _start_reads(self, slot: _Slot, buffers: list[int]) -> None:
        for slot_io in slot.writes:  # a read must see the last write of the same file
            slot_io.wait()
        slot.writes = []
        for kind, idx in zip(slot.kinds, buffers):
            slot.buffers[kind] = idx
            view = self.pool.view(idx, slot.numel, slot.kinds[kind])
            slot.reads.append(self.io.read(self._path(slot, kind), view))

    def _swap_in(self, slot: _Slot) -> None:
        if not slot.buffers:
            self._start_reads(slot, [self.pool.acquire() for _ in slot.kinds])

    def _prefetch(self, slot: _Slot) -> None:
        if slot.buffers:
            return
        buffers = self.pool.try_acquire(len(slot.kinds))
        if buffers is not None:
            self._start_reads(slot, buffers)

    def _finish_swap_in(self, slot: _Slot) -> None:
        for handle in slot.reads:
            handle.wait()
        slot.reads = []
        assert self.optimizer is not None
        slot.master.data = self.pool.view(slot.buffers[MASTER], slot.numel, slot.dtype)
        if slot.state_kinds:
            state = self.optimizer.state[slot.master]
            for kind in slot.state_kinds:
                state[kind] = self.pool.view(slot.buffers[kind], slot.numel, slot.kinds[kind])
        slot.resident = True

    def _swapped_state(self, slot: _Slot) -> dict[str, torch.Tensor]:
        """The optimizer-state tensors of ``slot`` that are swapped (same shape as the master)."""
        assert self.optimizer is not None
        state = self.optimizer.state.get(slot.master, {})
        return {
            k: v
            for k, v in state.items()
            if isinstance(v, torch.Tensor) and v.shape == slot.master.shape
        }

    def _swap_out(self, slot: _Slot, write: bool = True) -> None:
        """Start writing the slot back (if ``write``), release its buffers, drop its data."""
        assert self.optimizer is not None
        state = self.optimizer.state.get(slot.master)
        tensors = {MASTER: slot.master.data, **self._swapped_state(slot)}
        for kind in [k for k in tensors if k not in slot.kinds]:
            if write:  # first step (or a loaded checkpoint): a new state file
                self._check_new_kind(slot, kind, tensors[kind])
            else:  # not kept: the files stay as they were
                del tensors[kind]
                if state is not None:
                    del state[kind]
        for kind, tensor in tensors.items():
            handle = self.io.write(tensor.contiguous(), self._path(slot, kind)) if write else None
            if handle is not None:
                slot.writes.append(handle)
            idx = slot.buffers.pop(kind, None)
            if idx is not None:
                self.pool.release(idx, after=handle)
        for idx in slot.buffers.values():  # e.g. a state key the optimizer dropped
            self.pool.release(idx)
        slot.buffers = {}
        for kind in tensors:
            if kind != MASTER and state is not None:
                state[kind] = _empty(slot.kinds[kind])
        slot.master.data = _empty(slot.dtype)
        slot.resident = False

    def _check_new_kind(self, slot: _Slot, kind: str, tensor: torch.Tensor) -> None:
        if tensor.element_size() > max(_elt(d) for d in slot.kinds.values()) and self._pool:
            raise AssertionError(f"optimizer state {kind!r} is wider than the swap buffers")
        slot.kinds[kind] = tensor.dtype
        self.io.reserve(self._path(slot, kind), tensor.numel() * tensor.element_size())
        needed = len(slot.kinds)
        if needed > self.settings.buffer_count:
            raise ValueError(
                explain(
                    f"{self.settings.key}.buffer_count is too small: each master shard swaps "
                    f"{needed} tensors (the fp32 master and {needed - 1} optimizer-state tensors "
                    f"of {type(self.optimizer).__name__}) through one buffer each",
                    self.settings.buffer_count,
                    allowed=f">= {needed} (>= {2 * needed} to overlap reads with the step)",
                    fix=f'set "buffer_count": {2 * needed}',
                )
            )

    # -- the step ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, grads: list[torch.Tensor | None]) -> None:
        """One optimizer step over every master with a gradient (``grads`` in attach order)."""
        assert self.optimizer is not None
        todo = [
            (slot, g, wb)
            for slot, g, wb in zip(self._order, grads, self._write_backs)
            if g is not None
        ]
        for i, (slot, grad, write_back) in enumerate(todo):
            self._swap_in(slot)
            if i + 1 < len(todo):
                self._prefetch(todo[i + 1][0])
            self._finish_swap_in(slot)
            slot.master.grad = grad
            self.optimizer.step()
            slot.master.grad = None
            write_back()
            self._swap_out(slot)

    # -- whole-state access (checkpoints) ------------------------------------------------
    @contextlib.contextmanager
    def resident(self, write: bool) -> Iterator[None]:
        """Every master and its state in (fresh) host memory for the block.

        With ``write`` the (possibly replaced) values are written back to the swap files and
        into the parameter shards on exit; without, they are dropped. Uses one full copy
        of this rank's masters and optimizer state in host memory while inside.
        """
        assert self.optimizer is not None
        self.drain()
        reads = []
        for slot in self._order:
            fresh = {k: torch.empty(slot.numel, dtype=d) for k, d in slot.kinds.items()}
            reads += [self.io.read(self._path(slot, k), t) for k, t in fresh.items()]
            slot.master.data = fresh[MASTER]
            if slot.state_kinds:
                state = self.optimizer.state[slot.master]
                state.update({k: fresh[k] for k in slot.state_kinds})
            slot.resident = True
        for handle in reads:
            handle.wait()
        ok = False
        try:
            yield
            ok = True
        finally:
            for slot, write_back in zip(self._order, self._write_backs):
                if write and ok:
                    write_back()
                self._swap_out(slot, write=write and ok)
            self.drain()

    def overwrite_master(self, master: torch.Tensor, values: torch.Tensor) -> None:
        """Replace a master's stored values (e.g. after ``GatheredParameters`` edits)."""
        slot = self._slot(master)
        if slot.resident:
            master.data.copy_(values.reshape(-1))
            return
        for handle in slot.writes:
            handle.wait()
        data = values.detach().reshape(-1).to(device="cpu", dtype=slot.dtype).contiguous()
        slot.writes = [self.io.write(data, self._path(slot, MASTER))]

    # -- bookkeeping ---------------------------------------------------------------------
    def drain(self) -> None:
        """Wait for every read and write in flight."""
        for slot in self.slots:
            for handle in slot.reads + slot.writes:
                handle.wait()
            slot.writes = []
        if self._pool is not None:
            self._pool.drain()

    def storage_bytes(self) -> dict[str, int]:
        """``swap_buffers``: host staging buffers; ``nvme``: bytes in swap files."""
        files = sum(s.numel * _elt(d) for s in self.slots for d in s.kinds.values())
        pool = self._pool.total_bytes() if self._pool is not None else 0
        return {"swap_buffers": pool, "nvme": files}

    def close(self) -> None:
        self.drain()

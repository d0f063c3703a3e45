"""Collectives: ``torch.distributed`` calls with accounting and version shims.

Every function takes the arguments torch takes (``group=``, ``async_op=``) and returns what
torch returns (a ``Work`` handle when ``async_op=True``). Each call appends to the recent-ops
ring buffer; when the comms logger is enabled it is also timed (the accelerator is
synchronised around synchronous calls; an async call is timed until its handle's
``wait()`` returns, so an async op that is never waited on is not recorded).
The new-style names (``all_gather_into_tensor``, ``reduce_scatter_tensor``) are used, with
fallbacks for torch builds that lack them.

Every wrapper is ``@guarded`` (:mod:`shardspeed.comm.guard`): when the backend raises because the process group timed out
or broke (gloo raises; NCCL raises with ``TORCH_NCCL_BLOCKING_WAIT=1``), the error becomes
a :class:`~shardspeed.comm.errors.CollectiveTimeoutError` /
:class:`~shardspeed.comm.errors.CollectiveError` naming this rank, the collective, its
module/phase tag and the last collectives; async handles are wrapped in
:class:`GuardedWork` so a failing ``wait()`` reports the same way. Other errors (wrong
shapes, bad arguments) pass through unchanged.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardspeed.accelerator import get_accelerator
from shardspeed.comm.guard import GuardedWork, guarded
from shardspeed.comm.logger import COMMS_LOGGER, note_op

ReduceOp = dist.ReduceOp
Work = Any  # torch.distributed.Work (its import path moved between versions)


# Flat-tensor gather / reduce-scatter under their newest name: torch 2.13 renamed
# all_gather_into_tensor -> all_gather_single and reduce_scatter_tensor ->
# reduce_scatter_single (the old names warn); older builds only have the old names.
_ALL_GATHER_FLAT: Callable[..., Any] | None = getattr(dist, "all_gather_single", None) or getattr(
    dist, "all_gather_into_tensor", None
)
_REDUCE_SCATTER_FLAT: Callable[..., Any] | None = getattr(
    dist, "reduce_scatter_single", None
) or getattr(dist, "reduce_scatter_tensor", None)


def has_all_gather_into_tensor() -> bool:
    """True when torch has a flat-output all-gather (under either name)."""
    return _ALL_GATHER_FLAT is not None


def has_reduce_scatter_tensor() -> bool:
    """True when torch has a flat-input reduce-scatter (under either name)."""
    return _REDUCE_SCATTER_FLAT is not None


def has_coalescing_manager() -> bool:
    return hasattr(dist.distributed_c10d, "_coalescing_manager")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _Recorder:
    """Records one logged call once every handle it was split into has been waited on."""

    def __init__(self, op: str, key: str, msg_bytes: int, group: Any, start: float, n: int):
        self.op, self.key, self.msg_bytes, self.group = op, key, msg_bytes, group
        self.start, self.remaining = start, n

    def done(self) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            get_accelerator().synchronize()
            latency = time.perf_counter() - self.start
            group_size = (
                dist.get_world_size(self.group)
                if self.group is not None
                else (dist.get_world_size())
            )
            COMMS_LOGGER.record(self.op, self.msg_bytes, latency, group_size, key=self.key)


class TimedWork(GuardedWork):
    """A guarded handle whose ``wait()`` also records the op's latency (logger enabled)."""

    __slots__ = ("_recorder",)

    def __init__(self, work: Any, recorder: _Recorder, entry: tuple[Any, ...] | None = None):
        super().__init__(work, entry)
        self._recorder: _Recorder | None = recorder

    def _completed(self) -> None:
        if self._recorder is not None:
            recorder, self._recorder = self._recorder, None
            recorder.done()


_OWN_FILES = frozenset({__file__, sys.modules[GuardedWork.__module__].__file__})


def _caller() -> str:
    """``function (file:line)`` of the first frame outside this module and its guard."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in _OWN_FILES:
        frame = frame.f_back
    if frame is None:
        return "?"
    code = frame.f_code
    return f"{code.co_name} ({code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})"


def _timed(
    op_name: str,
    group: Any,
    msg_bytes: int,
    async_op: bool,
    fn: Callable[..., Any],
    /,
    *args: Any,
    **kw: Any,
) -> Any:
    """Run ``fn(*args, **kw)`` and record it (called only when the logger is enabled)."""
    if not COMMS_LOGGER.wants(op_name):
        return fn(*args, **kw)
    key = f"{op_name} | {_caller()}" if COMMS_LOGGER.debug else op_name
    get_accelerator().synchronize()
    start = time.perf_counter()
    result = fn(*args, **kw)
    if isinstance(result, list) and result and hasattr(result[0], "wait"):
        recorder = _Recorder(op_name, key, msg_bytes, group, start, len(result))
        return [TimedWork(w, recorder) for w in result]
    if async_op and result is not None:
        return TimedWork(result, _Recorder(op_name, key, msg_bytes, group, start, 1))
    _Recorder(op_name, key, msg_bytes, group, start, 1).done()
    return result


# ----------------------------------------------------------------- reductions
# Pattern of every op: note it in the ring buffer, then one boolean check; only the logged
# path computes message sizes or touches timers.


@guarded
def all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Work | None:
    """In-place all-reduce of ``tensor`` over ``group``."""
    note_op("all_reduce", group, tensor.numel(), tensor.dtype, async_op)
    if not COMMS_LOGGER.enabled:
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return _timed(
        "all_reduce", group, _nbytes(tensor), async_op,
        dist.all_reduce, tensor, op=op, group=group, async_op=async_op,
    )  # fmt: skip


def inference_all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Work | None:
    """Alias of :func:`all_reduce` (DeepSpeed's name for the inference path)."""
    return all_reduce(tensor, op=op, group=group, async_op=async_op)


@guarded
def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``tensor`` onto global rank ``dst``."""
    note_op("reduce", group, tensor.numel(), tensor.dtype, async_op)
    if not COMMS_LOGGER.enabled:
        return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)
    return _timed(
        "reduce", group, _nbytes(tensor), async_op,
        dist.reduce, tensor, dst, op=op, group=group, async_op=async_op,
    )  # fmt: skip


def _reduce_scatter_flat(
    output: torch.Tensor, input: torch.Tensor, op: Any, group: Any, async_op: bool
) -> Any:
    if _REDUCE_SCATTER_FLAT is not None:
        return _REDUCE_SCATTER_FLAT(output, input, op=op, group=group, async_op=async_op)
    chunks = list(input.chunk(dist.get_world_size(group)))
    return dist.reduce_scatter(output, chunks, op=op, group=group, async_op=async_op)


@guarded
def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``input`` (world x ``output``) and leave this rank's chunk in ``output``."""
    note_op("reduce_scatter_tensor", group, input.numel(), input.dtype, async_op)
    if not COMMS_LOGGER.enabled:
        return _reduce_scatter_flat(output, input, op, group, async_op)
    return _timed(
        "reduce_scatter_tensor", group, _nbytes(input), async_op,
        _reduce_scatter_flat, output, input, op, group, async_op,
    )  # fmt: skip


reduce_scatter_fn = reduce_scatter_tensor


@guarded
def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    """List form of :func:`reduce_scatter_tensor` (bytes: every input chunk)."""
    note_op("reduce_scatter", group, output.numel(), output.dtype, async_op)
    if not COMMS_LOGGER.enabled:
        return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)
    return _timed(
        "reduce_scatter", group, sum(_nbytes(t) for t in input_list), async_op,
        dist.reduce_scatter, output, input_list, op=op, group=group, async_op=async_op,
    )  # fmt: skip


# ----------------------------------------------------------------- gathers / broadcast
def _all_gather_flat(output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool) -> Any:
    if _ALL_GATHER_FLAT is not None:
        return _ALL_GATHER_FLAT(output, input, group=group, async_op=async_op)
    chunks = list(output.chunk(dist.get_world_size(group)))
    return dist.all_gather(chunks, input, group=group, async_op=async_op)


@guarded
def all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False
) -> Work | None:
    """Gather every rank's ``input`` into ``output`` (world x ``input``, rank order)."""
    note_op("all_gather_into_tensor", group, output.numel(), output.dtype, async_op)
    if not COMMS_LOGGER.enabled:
        return _all_gather_flat(output, input, group, async_op)
    return _timed(
        "all_gather_into_tensor", group, _nbytes(output), async_op,
        _all_gather_flat, output, input, group, async_op,
    )  # fmt: skip


@guarded
def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    """List all-gather (bytes: the whole output list)."""
    note_op("all_gather", group, tensor.numel(), tensor.dtype, async_op)
    if not COMMS_LOGGER.enabled:
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    return _timed(
        "all_gather", group, sum(_nbytes(t) for t in tensor_list), async_op,
        dist.all_gather, tensor_list, tensor, group=group, async_op=async_op,
    )  # fmt: skip


@guarded
def broadcast(
    tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False
) -> Work | None:
    """Broadcast ``tensor`` from global rank ``src``."""
    note_op("broadcast", group, tensor.numel(), tensor.dtype, async_op)
    if not COMMS_LOGGER.enabled:
        return dist.broadcast(tensor, src, group=group, async_op=async_op)
    return _timed(
        "broadcast", group, _nbytes(tensor), async_op,
        dist.broadcast, tensor, src, group=group, async_op=async_op,
    )  # fmt: skip


@guarded
def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    """All-to-all on one flat tensor (bytes: ``input``)."""
    note_op("all_to_all_single", group, input.numel(), input.dtype, async_op)
    args = (output, input, output_split_sizes, input_split_sizes)
    if not COMMS_LOGGER.enabled:
        return dist.all_to_all_single(*args, group=group, async_op=async_op)
    return _timed(
        "all_to_all_single", group, _nbytes(input), async_op,
        dist.all_to_all_single, *args, group=group, async_op=async_op,
    )  # fmt: skip


@guarded
def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    """Gather ``tensor`` from every rank into ``gather_list`` on global rank ``dst``."""
    note_op("gather", group, tensor.numel(), tensor.dtype, async_op)
    if not COMMS_LOGGER.enabled:
        return dist.gather(tensor, gather_list, dst, group=group, async_op=async_op)
    return _timed(
        "gather", group, _nbytes(tensor), async_op,
        dist.gather, tensor, gather_list, dst, group=group, async_op=async_op,
    )  # fmt: skip


@guarded
def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    """Scatter ``scatter_list`` from global rank ``src`` into every rank's ``tensor``."""
    note_op("scatter", group, tensor.numel(), tensor.dtype, async_op)
    if not COMMS_LOGGER.enabled:
        return dist.scatter(tensor, scatter_list, src, group=group, async_op=async_op)
    return _timed(
        "scatter", group, _nbytes(tensor), async_op,
        dist.scatter, tensor, scatter_list, src, group=group, async_op=async_op,
    )  # fmt: skip


# ----------------------------------------------------------------- point to point
@guarded
def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
    """Blocking send to global rank ``dst``."""
    note_op("send", group, tensor.numel(), tensor.dtype, False)
    if not COMMS_LOGGER.enabled:
        return dist.send(tensor, dst, group=group, tag=tag)
    return _timed(
        "send", group, _nbytes(tensor), False, dist.send, tensor, dst, group=group, tag=tag
    )


@guarded
def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> int:
    """Blocking receive into ``tensor``; returns the sender's rank."""
    note_op("recv", group, tensor.numel(), tensor.dtype, False)
    if not COMMS_LOGGER.enabled:
        return dist.recv(tensor, src, group=group, tag=tag)
    return _timed(
        "recv", group, _nbytes(tensor), False, dist.recv, tensor, src, group=group, tag=tag
    )


@guarded
def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Work:
    """Non-blocking send; returns a handle to ``wait()`` on."""
    note_op("isend", group, tensor.numel(), tensor.dtype, True)
    if not COMMS_LOGGER.enabled:
        return dist.isend(tensor, dst, group=group, tag=tag)
    return _timed(
        "isend", group, _nbytes(tensor), True, dist.isend, tensor, dst, group=group, tag=tag
    )


@guarded
def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> Work:
    """Non-blocking receive; returns a handle to ``wait()`` on."""
    note_op("irecv", group, tensor.numel(), tensor.dtype, True)
    if not COMMS_LOGGER.enabled:
        return dist.irecv(tensor, src, group=group, tag=tag)
    return _timed(
        "irecv", group, _nbytes(tensor), True, dist.irecv, tensor, src, group=group, tag=tag
    )


_TORCH_P2P = {isend: dist.isend, irecv: dist.irecv}


class P2POp(dist.P2POp):
    """``torch.distributed.P2POp`` that also accepts :func:`isend`/:func:`irecv` from here."""

    def __new__(cls, op: Callable, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> P2POp:
        return super().__new__(cls, _TORCH_P2P.get(op, op), tensor, *args, **kwargs)

    def __init__(self, op: Callable, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        super().__init__(_TORCH_P2P.get(op, op), tensor, *args, **kwargs)


@guarded
def batch_isend_irecv(p2p_op_list: list[Any]) -> list[Work]:
    """Issue a batch of :class:`P2POp`; returns one handle per op (bytes: all tensors)."""
    first = p2p_op_list[0] if p2p_op_list else None
    note_op(
        "batch_isend_irecv",
        None if first is None else first.group,
        sum(p.tensor.numel() for p in p2p_op_list),
        None if first is None else first.tensor.dtype,
        True,
    )
    if not COMMS_LOGGER.enabled:
        return dist.batch_isend_irecv(p2p_op_list)
    total = sum(_nbytes(p.tensor) for p in p2p_op_list)
    group = None if first is None else first.group
    return _timed("batch_isend_irecv", group, total, True, dist.batch_isend_irecv, p2p_op_list)


# ----------------------------------------------------------------- sync and objects
@guarded
def barrier(
    group: Any = None, async_op: bool = False, device_ids: list[int] | None = None
) -> Work | None:
    """Wait until every rank of ``group`` arrives."""
    note_op("barrier", group, 0, None, async_op)
    if not COMMS_LOGGER.enabled:
        return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)
    return _timed(
        "barrier", group, 0, async_op,
        dist.barrier, group=group, async_op=async_op, device_ids=device_ids,
    )  # fmt: skip


@guarded
def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
    """Gloo barrier that names the ranks that failed to arrive within ``timeout``."""
    note_op("monitored_barrier", group, 0, None, False)
    kw = {"group": group, "timeout": timeout, "wait_all_ranks": wait_all_ranks}
    if not COMMS_LOGGER.enabled:
        return dist.monitored_barrier(**kw)
    return _timed("monitored_barrier", group, 0, False, dist.monitored_barrier, **kw)


@guarded
def broadcast_object_list(
    object_list: list[Any], src: int = 0, group: Any = None, device: torch.device | None = None
) -> None:
    """Broadcast picklable objects from global rank ``src`` (in place in ``object_list``)."""
    note_op("broadcast_object_list", group, len(object_list), None, False)
    if not COMMS_LOGGER.enabled:
        return dist.broadcast_object_list(object_list, src, group=group, device=device)
    return _timed(
        "broadcast_object_list", group, 0, False,
        dist.broadcast_object_list, object_list, src, group=group, device=device,
    )  # fmt: skip


@guarded
def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """Gather one picklable object per rank into ``object_list`` (rank order)."""
    note_op("all_gather_object", group, 1, None, False)
    if not COMMS_LOGGER.enabled:
        return dist.all_gather_object(object_list, obj, group=group)
    return _timed(
        "all_gather_object", group, 0, False, dist.all_gather_object, object_list, obj, group=group
    )

"""Point-to-point exchange of activations and gradients between pipeline stages.

Activations are a tensor or a tuple of tensors whose shapes the receiver cannot know in
advance, so the first transfer on each channel (local chunk x direction) is preceded by
its metadata: ``[is_tuple, num_tensors, (dtype, requires_grad, ndim, *shape)...]`` as an
int64 tensor (its length sent first). Both ends then cache it, so later micro-batches
send data only; ``reset_shapes()`` (or ``dynamic_shape=True``) renegotiates. Gradient
shapes need no negotiation: they are those of the activation tensors that require grad.

Sends are non-blocking (``isend``; finished handles are dropped, ``wait_sends`` drains
the rest); receives are posted (``irecv``) and waited on only when the data is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardspeed import comm

_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
)  # fmt: skip
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass(frozen=True)
class ActivationMeta:
    """Structure of an activation: a bare tensor or a tuple, and each tensor's meta."""

    is_tuple: bool
    tensors: tuple[TensorMeta, ...]

    @classmethod
    def of(cls, value: Any) -> ActivationMeta:
        tensors = as_tensor_tuple(value, "a pipeline stage's output")
        return cls(
            isinstance(value, tuple),
            tuple(TensorMeta(tuple(t.shape), t.dtype, t.requires_grad) for t in tensors),
        )

    def encode(self) -> list[int]:
        out = [int(self.is_tuple), len(self.tensors)]
        for t in self.tensors:
            out += [_DTYPE_CODE[t.dtype], int(t.requires_grad), len(t.shape), *t.shape]
        return out

    @classmethod
    def decode(cls, values: Sequence[int]) -> ActivationMeta:
        is_tuple, count = bool(values[0]), values[1]
        pos, tensors = 2, []
        for _ in range(count):
            code, grad, ndim = values[pos : pos + 3]
            shape = tuple(values[pos + 3 : pos + 3 + ndim])
            tensors.append(TensorMeta(shape, _DTYPES[code], bool(grad)))
            pos += 3 + ndim
        return cls(is_tuple, tuple(tensors))


def as_tensor_tuple(value: Any, what: str) -> tuple[torch.Tensor, ...]:
    """``value`` as a tuple of tensors; ``ValueError`` for anything else."""
    items = value if isinstance(value, tuple) else (value,)
    for item in items:
        if not isinstance(item, torch.Tensor):
            raise ValueError(
                f"{what} must be a tensor or a tuple of tensors to cross a pipeline stage "
                f"boundary, got an element of type {type(item).__name__}; return tensors only "
                "(encode flags as tensors)."
            )
        if item.dtype not in _DTYPE_CODE:
            raise ValueError(f"{what}: dtype {item.dtype} cannot be sent between stages.")
    return items


class PendingRecv:
    """A posted receive; ``wait()`` returns the tensor (or tuple) with ``requires_grad`` set."""

    def __init__(self, buffers: list[torch.Tensor], works: list[Any], meta: ActivationMeta | None):
        self.buffers = buffers
        self.works = works
        self.meta = meta

    def wait(self) -> Any:
        for work in self.works:
            work.wait()
        self.works = []
        if self.meta is None:  # gradients: a plain list
            return self.buffers
        for buf, m in zip(self.buffers, self.meta.tensors):
            if m.requires_grad:
                buf.requires_grad_(True)
        return tuple(self.buffers) if self.meta.is_tuple else self.buffers[0]


class StageLink:
    """This stage's p2p endpoint. ``stage_ranks[s]``: global rank of stage ``s`` in our pipe."""

    def __init__(
        self, stage_ranks: Sequence[int], device: torch.device, dynamic_shape: bool = False
    ) -> None:
        self.stage_ranks = list(stage_ranks)
        self.device = device
        self.dynamic_shape = dynamic_shape
        self._sent_meta: dict[int, ActivationMeta] = {}  # local chunk -> output meta
        self._recv_meta: dict[int, ActivationMeta] = {}  # local chunk -> input meta
        self._pending_sends: list[tuple[Any, torch.Tensor]] = []

    def reset_shapes(self) -> None:
        """Forget negotiated shapes (call on every rank at the same point)."""
        self._sent_meta.clear()
        self._recv_meta.clear()

    # -- activations -------------------------------------------------------------------
    def send_activation(self, value: Any, chunk: int, peer: int) -> None:
        dst = self.stage_ranks[peer]
        if self.dynamic_shape or chunk not in self._sent_meta:
            meta = ActivationMeta.of(value)
            self._send_meta(meta, dst)
            self._sent_meta[chunk] = meta
        for tensor in as_tensor_tuple(value, "a pipeline stage's output"):
            self._isend(tensor.detach(), dst)

    def recv_activation(self, chunk: int, peer: int) -> PendingRecv:
        src = self.stage_ranks[peer]
        if self.dynamic_shape or chunk not in self._recv_meta:
            self._recv_meta[chunk] = self._recv_meta_from(src)
        meta = self._recv_meta[chunk]
        buffers = [torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in meta.tensors]
        works = [comm.irecv(buf, src) for buf in buffers]
        return PendingRecv(buffers, works, meta)

    # -- gradients ---------------------------------------------------------------------
    def send_grads(self, grads: Sequence[torch.Tensor], peer: int) -> None:
        dst = self.stage_ranks[peer]
        for grad in grads:
            self._isend(grad, dst)

    def recv_grads(self, like: Sequence[torch.Tensor], peer: int) -> PendingRecv:
        src = self.stage_ranks[peer]
        buffers = [torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in like]
        works = [comm.irecv(buf, src) for buf in buffers]
        return PendingRecv(buffers, works, None)

    # -- plumbing ----------------------------------------------------------------------
    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        tensor = tensor.contiguous()
        self._pending_sends = [(w, t) for w, t in self._pending_sends if not w.is_completed()]
        self._pending_sends.append((comm.isend(tensor, dst), tensor))

    def wait_sends(self) -> None:
        """Block until every send issued so far has completed."""
        for work, _ in self._pending_sends:
            work.wait()
        self._pending_sends = []

    def _send_meta(self, meta: ActivationMeta, dst: int) -> None:
        values = torch.tensor(meta.encode(), dtype=torch.int64, device=self.device)
        self._isend(torch.tensor([values.numel()], dtype=torch.int64, device=self.device), dst)
        self._isend(values, dst)

    def _recv_meta_from(self, src: int) -> ActivationMeta:
        length = torch.empty(1, dtype=torch.int64, device=self.device)
        comm.recv(length, src)
        values = torch.empty(int(length.item()), dtype=torch.int64, device=self.device)
        comm.recv(values, src)
        return ActivationMeta.decode(values.tolist())

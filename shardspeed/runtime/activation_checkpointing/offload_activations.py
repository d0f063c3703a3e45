"""Move the hidden states kept at checkpoint boundaries to host memory until backward.

With activation checkpointing a model keeps, per checkpointed layer, only the layer's input
(``hidden_states``: ``(B, T, H)``). For long sequences those inputs dominate what remains on
the device. :class:`CheckpointHiddenStatesOffload` is a ``saved_tensors_hooks`` context
that sends exactly those tensors to host buffers in forward and copies them back when the
recompute in backward asks for them; every other saved tensor passes through untouched.

How a saved tensor is recognised as a checkpoint input: while a context is active,
``transformers.GradientCheckpointingLayer.__call__`` is wrapped so that a layer running
with gradient checkpointing marks its first positional argument (by ``id``) before calling
the layer. The pack hook offloads a saved tensor only when it consumes such a mark. The
wrapper is installed on the first ``__enter__`` and removed when the last context exits.

The copies (:class:`_ActivationOffloadEngine`):

* the newest ``keep_last_count`` inputs stay on the device, since the first backward
  layers need them before a device-to-host copy could finish;
* older ones are copied into pooled (pinned) host buffers on a side stream; the device
  tensor stays referenced for ``max_fwd_stash_count`` more offloads so a quick backward
  can use it without a copy back;
* restoring copies host -> device into a fresh tensor with the original strides.

Only tensors on an asynchronous accelerator (CUDA) are offloaded. On a CPU-only host the
context is a no-op that counts every marked tensor as ``skipped_marked_tensors``, exactly
as DeepSpeed's, because the hidden states already live in host memory.

Backward must run inside the ``with`` block: leaving it drops the host copies.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from shardspeed.accelerator import get_accelerator

logger = logging.getLogger(__name__)

# (shape, dtype, layout, pinned): host buffers are dense, so this is all a reuse must match
_BufferKey = tuple[tuple[int, ...], torch.dtype, torch.layout, bool]


@dataclass
class CheckpointActivationOffloadStats:
    """Counters for one ``with`` block (reset on ``__enter__``, readable after exit)."""

    saved_tensors_seen: int = 0  # every tensor autograd saved while the hooks were active
    marked_tensors: int = 0  # checkpoint-layer inputs marked by the layer wrapper
    offloaded_tensors: int = 0  # copies started to host memory
    restored_tensors: int = 0  # offloaded tensors handed back for backward
    skipped_marked_tensors: int = 0  # marked but not offloadable (host tensor, small, param)
    kept_last_tensors: int = 0  # handed back from the newest inputs kept on the device
    offloaded_bytes: int = 0
    restored_bytes: int = 0


@dataclass(frozen=True)
class _OffloadedTensorRef:
    """What autograd keeps in place of an offloaded (or kept-last) tensor."""

    tensor_id: int


@dataclass(frozen=True)
class _HostCopy:
    """A host copy and what is needed to rebuild the device tensor from it."""

    host: torch.Tensor
    device: torch.device
    shape: torch.Size
    stride: tuple[int, ...]
    key: _BufferKey


def _num_bytes(tensor: torch.Tensor) -> int:
    return tensor.element_size() * tensor.nelement()


def _on_async_accelerator(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives on a device worth offloading from (CUDA, not the CPU)."""
    accelerator = get_accelerator()
    return not accelerator.is_synchronized_device() and accelerator.on_accelerator(tensor)


def _check_count(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(
            f"{name} must be >= 0, got {value}; pass a non-negative count (0 turns it off)."
        )


class _ActivationOffloadEngine:
    """Asynchronous device -> host copies of activations with pooled host buffers.

    Callers hand tensors to :meth:`offload_input` (which returns an id, or ``None`` when the
    tensor stays where it is) and get them back with :meth:`restore_input`.
    """

    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool = True,
        min_offload_bytes: int = 1024,
        max_fwd_stash_count: int = 2,
        max_cpu_buffer_pool_count: int = 64,
        keep_last_count: int = 1,
    ) -> None:
        _check_count("keep_last_count", keep_last_count)
        _check_count("max_fwd_stash_count", max_fwd_stash_count)
        _check_count("max_cpu_buffer_pool_count", max_cpu_buffer_pool_count)
        _check_count("min_offload_bytes", min_offload_bytes)
        self.use_pin_memory = use_pin_memory
        self.min_offload_bytes = min_offload_bytes
        self.max_fwd_stash_count = max_fwd_stash_count
        self.max_cpu_buffer_pool_count = max_cpu_buffer_pool_count
        self.keep_last_count = keep_last_count
        self.stats = CheckpointActivationOffloadStats()
        stream_cls = get_accelerator().Stream  # None on the CPU: no side stream there
        self.s1: Any = stream_cls() if use_streams and stream_cls is not None else None
        self.use_streams = self.s1 is not None
        self._next_id = 0
        self._tracker: dict[int, _HostCopy] = {}  # id -> host copy awaiting restore
        self._fwd_stash: dict[int, tuple[torch.Tensor, Any]] = {}  # id -> (device tensor, event)
        self._keep_last: dict[int, torch.Tensor] = {}  # newest inputs, still on the device
        self._restored: dict[int, torch.Tensor] = {}  # id -> restored tensor (repeat unpacks)
        self._cpu_buffer_pool: dict[_BufferKey, list[torch.Tensor]] = {}
        self._cpu_buffer_pool_count = 0
        self._pending_cpu_buffers: list[tuple[_BufferKey, torch.Tensor, Any]] = []

    # -- streams -------------------------------------------------------------------------
    @property
    def compute_stream(self) -> Any:
        """The current stream, looked up on each use (the caller may switch streams)."""
        return get_accelerator().current_stream()

    def _copy_stream(self) -> contextlib.AbstractContextManager[Any]:
        if self.use_streams:
            return get_accelerator().stream(self.s1)
        return contextlib.nullcontext()

    # -- host buffers --------------------------------------------------------------------
    def _buffer_key(self, tensor: torch.Tensor) -> _BufferKey:
        return (tuple(tensor.size()), tensor.dtype, tensor.layout, self.use_pin_memory)

    def _pool_cpu_buffer(self, key: _BufferKey, buffer: torch.Tensor) -> None:
        if self._cpu_buffer_pool_count < self.max_cpu_buffer_pool_count:
            self._cpu_buffer_pool.setdefault(key, []).append(buffer)
            self._cpu_buffer_pool_count += 1

    def _reap_cpu_buffer_pool(self, force: bool = False) -> None:
        """Return host buffers whose host -> device copy has finished to the pool."""
        pending, self._pending_cpu_buffers = self._pending_cpu_buffers, []
        for key, buffer, event in pending:
            if force:
                event.synchronize()
            elif not event.query():
                self._pending_cpu_buffers.append((key, buffer, event))
                continue
            self._pool_cpu_buffer(key, buffer)

    def _empty_cpu_like(self, tensor: torch.Tensor) -> tuple[torch.Tensor, _BufferKey]:
        self._reap_cpu_buffer_pool()
        key = self._buffer_key(tensor)
        pool = self._cpu_buffer_pool.get(key)
        if pool:
            self._cpu_buffer_pool_count -= 1
            return pool.pop(), key
        host = torch.empty(tuple(tensor.size()), dtype=tensor.dtype, layout=tensor.layout)
        if self.use_pin_memory:
            host = get_accelerator().pin_memory(host)  # unchanged on the CPU
        return host, key

    # -- offload -------------------------------------------------------------------------
    def _should_skip(self, tensor: torch.Tensor) -> bool:
        is_buffer = hasattr(torch.nn, "Buffer") and isinstance(tensor, torch.nn.Buffer)
        # a broadcast (stride-0) view cannot be rebuilt by copying into fresh storage
        is_overlapping = tensor.numel() > 1 and 0 in tensor.stride()
        return (
            not _on_async_accelerator(tensor)
            or _num_bytes(tensor) < self.min_offload_bytes
            or isinstance(tensor, torch.nn.Parameter)
            or is_buffer
            or is_overlapping
        )

    def _reap_forward_stash(self, newest_id: int) -> None:
        """Drop device references older than the stash window (``record_stream`` keeps the
        memory alive until the side stream is done with it)."""
        for tensor_id in list(self._fwd_stash):
            if tensor_id <= newest_id - self.max_fwd_stash_count:
                del self._fwd_stash[tensor_id]

    def _start_offload(self, tensor_id: int, tensor: torch.Tensor, newest_id: int) -> None:
        if self.use_streams:
            self._reap_forward_stash(newest_id)
            self.s1.wait_stream(self.compute_stream)
        with self._copy_stream():
            host, key = self._empty_cpu_like(tensor)
            host.copy_(tensor.detach(), non_blocking=self.use_streams)
        self._tracker[tensor_id] = _HostCopy(
            host, tensor.device, tensor.size(), tensor.stride(), key
        )
        if self.use_streams:
            tensor.record_stream(self.s1)
            if self.max_fwd_stash_count > 0:
                self._fwd_stash[tensor_id] = (tensor, self.s1.record_event())
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += _num_bytes(host)

    def offload_input(self, tensor: torch.Tensor) -> int | None:
        """Take ``tensor`` for offload; its id for :meth:`restore_input`, or ``None`` if it
        is not offloadable (then the caller keeps the tensor itself)."""
        if self._should_skip(tensor):
            self.stats.skipped_marked_tensors += 1
            return None
        self._next_id += 1
        newest_id = self._next_id
        self._keep_last[newest_id] = tensor
        while len(self._keep_last) > self.keep_last_count:
            oldest_id = next(iter(self._keep_last))
            self._start_offload(oldest_id, self._keep_last.pop(oldest_id), newest_id)
        return newest_id

    # -- restore -------------------------------------------------------------------------
    def restore_input(self, tensor_id: int) -> torch.Tensor:
        """The tensor behind ``tensor_id``, back on its device; the id is consumed."""
        return self._restore_tensor(tensor_id, cache=False)

    def _restore_tensor(self, tensor_id: int, cache: bool = True) -> torch.Tensor:
        """Restore ``tensor_id``; with ``cache`` a repeated unpack (``retain_graph``) gets
        the same tensor until the context exits."""
        if cache and tensor_id in self._restored:
            return self._restored[tensor_id]
        if tensor_id in self._keep_last:
            tensor = self._keep_last.pop(tensor_id)
            self.stats.kept_last_tensors += 1
        elif tensor_id in self._fwd_stash:
            tensor, event = self._fwd_stash.pop(tensor_id)
            self.compute_stream.wait_event(event)
            copy = self._tracker.pop(tensor_id)
            self._pool_cpu_buffer(copy.key, copy.host)
            self._count_restore(tensor)
        else:
            tensor = self._copy_back(tensor_id)
            self._count_restore(tensor)
        if cache:
            self._restored[tensor_id] = tensor
        return tensor

    def _count_restore(self, tensor: torch.Tensor) -> None:
        self.stats.restored_tensors += 1
        self.stats.restored_bytes += _num_bytes(tensor)

    def _copy_back(self, tensor_id: int) -> torch.Tensor:
        copy = self._tracker.pop(tensor_id, None)
        if copy is None:
            raise RuntimeError(
                f"offloaded activation {tensor_id} is no longer held: its host copy was "
                "dropped when the offload context exited or was reset. Run backward() inside "
                "the same `with CheckpointHiddenStatesOffload(...)` block as the forward."
            )
        with self._copy_stream():
            # fresh storage at offset 0 with the source strides (the host buffer is dense)
            tensor = torch.empty_strided(
                copy.shape, copy.stride, dtype=copy.host.dtype, device=copy.device
            )
            tensor.copy_(copy.host, non_blocking=self.use_streams)
        if self.use_streams:
            event = self.s1.record_event()
            self.compute_stream.wait_event(event)
            tensor.record_stream(self.compute_stream)
            self._pending_cpu_buffers.append((copy.key, copy.host, event))
        else:
            self._pool_cpu_buffer(copy.key, copy.host)
        return tensor

    # -- lifetime ------------------------------------------------------------------------
    def _sync_copy_streams(self) -> None:
        if self.use_streams:
            self.s1.synchronize()
            self._reap_cpu_buffer_pool(force=True)

    def _clear(self) -> None:
        self._tracker.clear()
        self._fwd_stash.clear()
        self._keep_last.clear()
        self._restored.clear()
        self._pending_cpu_buffers.clear()

    def reset(self) -> None:
        """Wait for copies in flight, then forget every tensor and zero the stats."""
        self._sync_copy_streams()
        self._clear()
        self.stats = CheckpointActivationOffloadStats()
        self._next_id = 0

    def _sync_and_clear(self) -> None:
        """Wait for copies in flight, pool the unused host buffers, forget every tensor."""
        self._sync_copy_streams()
        for copy in self._tracker.values():
            self._pool_cpu_buffer(copy.key, copy.host)
        self._clear()


# -- the GradientCheckpointingLayer marker ------------------------------------------------
class _MarkerPatch:
    """Process-wide state of the ``GradientCheckpointingLayer.__call__`` wrapper."""

    lock = threading.Lock()
    wrapper: Any = None  # the installed wrapper, None when not installed
    original: Any = None  # the class's own __call__ before patching (None: inherited)
    installed_by_context = False  # removed again when the last context exits
    num_users = 0  # contexts entered while the wrapper is installed


_THREAD_STATE = threading.local()


def _manager_stack() -> list[CheckpointHiddenStatesOffload]:
    if not hasattr(_THREAD_STATE, "stack"):
        _THREAD_STATE.stack = []
    return _THREAD_STATE.stack


def _current_manager() -> CheckpointHiddenStatesOffload | None:
    stack = _manager_stack()
    return stack[-1] if stack else None


def _gradient_checkpointing_layer() -> type[torch.nn.Module]:
    try:
        from transformers import GradientCheckpointingLayer
    except ImportError as err:
        raise RuntimeError(
            "patch_gradient_checkpointing_layer_marker needs transformers >= 4.52 (the "
            "release with GradientCheckpointingLayer); install or upgrade it with "
            "`pip install -U transformers`."
        ) from err
    return GradientCheckpointingLayer


def patch_gradient_checkpointing_layer_marker() -> None:
    """Wrap ``GradientCheckpointingLayer.__call__`` so that a layer running with gradient
    checkpointing marks its ``hidden_states`` (first positional argument) for the active
    :class:`CheckpointHiddenStatesOffload`. Idempotent; when called directly (not by a
    context) the wrapper stays installed."""
    if _MarkerPatch.wrapper is not None:
        return
    layer_cls = _gradient_checkpointing_layer()
    inherited_call = layer_cls.__call__

    def _checkpoint_offload_call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        manager = _current_manager()
        marked = None
        checkpointing = getattr(self, "gradient_checkpointing", False)
        if manager is not None and self.training and torch.is_grad_enabled() and checkpointing:
            # only positional args reach the checkpoint's saved inputs; a keyword
            # hidden_states stays inside the recompute closure and is never packed
            if args and torch.is_tensor(args[0]):
                marked = args[0]
                manager.mark(marked)
        try:
            return inherited_call(self, *args, **kwargs)
        finally:
            if marked is not None:
                manager._consume_mark(marked)  # ids are recycled: drop an unused mark

    _MarkerPatch.original = layer_cls.__dict__.get("__call__")
    layer_cls.__call__ = _checkpoint_offload_call
    _MarkerPatch.wrapper = _checkpoint_offload_call


def _unpatch_gradient_checkpointing_layer_marker() -> None:
    wrapper, original = _MarkerPatch.wrapper, _MarkerPatch.original
    _MarkerPatch.wrapper = _MarkerPatch.original = None
    if wrapper is None:
        return
    layer_cls = _gradient_checkpointing_layer()
    if layer_cls.__dict__.get("__call__") is not wrapper:
        return  # someone patched over us; leave theirs in place
    if original is None:
        delattr(layer_cls, "__call__")
    else:
        layer_cls.__call__ = original


# -- the context manager ------------------------------------------------------------------
class CheckpointHiddenStatesOffload(_ActivationOffloadEngine, saved_tensors_hooks):
    """``saved_tensors_hooks`` that offload only the marked checkpoint-layer inputs.

    Use around forward *and* backward::

        with CheckpointHiddenStatesOffload():
            loss = model(**batch).loss
            loss.backward()

    Not re-entrant (nest a second instance instead). ``stats`` counts one ``with`` block.
    """

    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool = True,
        min_offload_bytes: int = 1024,
        max_fwd_stash_count: int = 2,
        max_cpu_buffer_pool_count: int = 64,
        keep_last_count: int = 1,
    ) -> None:
        _ActivationOffloadEngine.__init__(
            self,
            use_pin_memory=use_pin_memory,
            use_streams=use_streams,
            min_offload_bytes=min_offload_bytes,
            max_fwd_stash_count=max_fwd_stash_count,
            max_cpu_buffer_pool_count=max_cpu_buffer_pool_count,
            keep_last_count=keep_last_count,
        )
        self._allowed: dict[int, int] = {}  # id(tensor) -> marks not yet consumed
        saved_tensors_hooks.__init__(self, self._pack_tensor, self._unpack_tensor)

    def mark(self, tensor: torch.Tensor) -> None:
        """Let the next save of ``tensor`` be offloaded."""
        self._allowed[id(tensor)] = self._allowed.get(id(tensor), 0) + 1
        self.stats.marked_tensors += 1

    def _consume_mark(self, tensor: torch.Tensor) -> bool:
        count = self._allowed.get(id(tensor), 0)
        if count == 0:
            return False
        if count == 1:
            del self._allowed[id(tensor)]
        else:
            self._allowed[id(tensor)] = count - 1
        return True

    def _pack_tensor(self, tensor: torch.Tensor) -> torch.Tensor | _OffloadedTensorRef:
        self.stats.saved_tensors_seen += 1
        if not self._consume_mark(tensor):
            return tensor
        tensor_id = self.offload_input(tensor)
        return tensor if tensor_id is None else _OffloadedTensorRef(tensor_id)

    def _unpack_tensor(self, packed: torch.Tensor | _OffloadedTensorRef) -> torch.Tensor:
        if isinstance(packed, _OffloadedTensorRef):
            return self._restore_tensor(packed.tensor_id, cache=True)
        return packed

    def reset(self) -> None:
        super().reset()
        self._allowed.clear()

    def _sync_and_clear(self) -> None:
        super()._sync_and_clear()
        self._allowed.clear()

    def _pop_manager_stack(self) -> None:
        stack = _manager_stack()
        if self in stack:
            stack.remove(self)
        with _MarkerPatch.lock:
            _MarkerPatch.num_users = max(_MarkerPatch.num_users - 1, 0)
            if _MarkerPatch.num_users == 0 and _MarkerPatch.installed_by_context:
                _unpatch_gradient_checkpointing_layer_marker()
                _MarkerPatch.installed_by_context = False

    def __enter__(self) -> CheckpointHiddenStatesOffload:
        if self in _manager_stack():
            raise RuntimeError(
                "CheckpointHiddenStatesOffload is not re-entrant: this instance is already "
                "active. Create a separate instance for a nested `with` block."
            )
        with _MarkerPatch.lock:
            if _MarkerPatch.wrapper is None and importlib.util.find_spec("transformers"):
                patch_gradient_checkpointing_layer_marker()
                _MarkerPatch.installed_by_context = True
            if _MarkerPatch.wrapper is not None:
                _MarkerPatch.num_users += 1
        self.reset()
        _manager_stack().append(self)
        try:
            saved_tensors_hooks.__enter__(self)
        except Exception:
            self._pop_manager_stack()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        sync_error: Exception | None = None
        try:
            self._sync_and_clear()
        except Exception as err:  # re-raised below, after the hooks and patch are undone
            sync_error = err
        try:
            self._pop_manager_stack()
        finally:
            saved_tensors_hooks.__exit__(self, *exc_info)
        logger.debug("checkpoint hidden-state offload: %s", self.stats)
        if sync_error is not None:
            raise sync_error


def get_checkpoint_hidden_states_offloading_ctx_manager(
    use_pin_memory: bool = True,
    use_streams: bool = True,
    min_offload_bytes: int = 1024,
    max_fwd_stash_count: int = 2,
    max_cpu_buffer_pool_count: int = 64,
    keep_last_count: int = 1,
) -> CheckpointHiddenStatesOffload:
    """A new :class:`CheckpointHiddenStatesOffload` (the name frameworks import)."""
    return CheckpointHiddenStatesOffload(
        use_pin_memory=use_pin_memory,
        use_streams=use_streams,
        min_offload_bytes=min_offload_bytes,
        max_fwd_stash_count=max_fwd_stash_count,
        max_cpu_buffer_pool_count=max_cpu_buffer_pool_count,
        keep_last_count=keep_last_count,
    )

"""ZeRO-Inference for the FastGen engine: stream decoder layers' weights onto the device.

The decoder layers' parameters and buffers (quantized int4/int8 buffers included)
live in a :class:`~.offload_store.WeightStore` (host memory or NVMe files). The
device keeps only the resident parts (embeddings, final norm, lm_head, rotary
tables), the KV cache and a ring of ``prefetch + 1`` layer-sized buffers::

    fetch k  -> ring[k % R]        (k counts fetches; layers go 0, 1, ..., L-1, 0, ...)
    layer i runs from the buffer of its fetch while fetches k+1..k+prefetch are in flight

Hooks on each layer do the work, so the model's own ``forward`` is unchanged:

* pre-hook of layer i: wait for its fetch, point the layer's tensors at its ring
  buffer, start fetching the next layers (cyclically: the last layer prefetches
  the first ones of the next step);
* post-hook of layer i (CUDA): record an event; the copy that reuses the buffer
  waits for it.

On CUDA the host images are page-locked and copied with ``non_blocking=True`` on
a side stream; one worker thread reads NVMe files into page-locked staging
buffers (one per ring buffer) ahead of the copy. On CPU the "device" is host
memory too, so the ring is still a separate buffer the worker thread fills while
the previous layer computes.

Loading: the engine builds (and quantizes) the model on the host, choosing kernels
for the compute device. The streamer then, one layer at a time, packs each decoder
layer into the store and drops the layer's host tensors; only then does it allocate
the ring and move the resident modules to the device. So the device never holds more
than resident + ring, at load as while generating (:attr:`LayerStreamer.load_peak_bytes`).

Limits: decoder layers must not share tensors with other parts; ``compile_decode``
cannot be combined (captured graphs keep buffer addresses).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn as nn

from shardspeed.inference.fastgen.offload_config import OffloadConfig
from shardspeed.inference.fastgen.offload_store import (
    HostStore,
    NvmeStore,
    TensorSlot,
    WeightStore,
    host_buffer,
    pack_image,
    plan_layout,
)
from shardspeed.utils.logging import get_logger

__all__ = ["LayerStreamer", "decoder_layers", "enable_weight_offload"]

logger = get_logger(__name__)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder layers: the direct ``ModuleList`` child with
    ``model.num_layers`` entries (``layers`` in Llama-likes, ``h`` in GPT-2)."""
    num_layers = getattr(model, "num_layers", None)
    found = [
        child
        for child in model.children()
        if isinstance(child, nn.ModuleList) and len(child) == num_layers
    ]
    if len(found) != 1:
        raise ValueError(
            f"EngineConfig.offload: cannot tell the decoder layers of {type(model).__name__} "
            f"(found {len(found)} ModuleList children with num_layers={num_layers} entries; "
            "need exactly one); run this model without offload."
        )
    return found[0]


@dataclass(frozen=True)
class _Binding:
    """One tensor of a layer: ``module.<name>`` is a parameter or a buffer."""

    module: nn.Module
    name: str
    is_param: bool


def _layer_tensors(layer: nn.Module) -> tuple[list[_Binding], list[torch.Tensor]]:
    """(bindings, tensors) of every parameter and buffer in ``layer``; tensors are unique."""
    bindings, tensors, seen = [], [], {}
    for module in layer.modules():
        for kind, table in ((True, module._parameters), (False, module._buffers)):
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) in seen and seen[id(t)] is not module:
                    raise ValueError(
                        f"EngineConfig.offload: tensor {name!r} is shared between modules of one "
                        "decoder layer; offload supports layers whose tensors are their own."
                    )
                seen[id(t)] = module
                bindings.append(_Binding(module, name, kind))
                tensors.append(t)
    return bindings, tensors


class LayerStreamer:
    """Keeps decoder layers in a store and streams them through a device ring buffer.

    ``model`` may be on the host (the engine builds it there when offloading): the
    layers go to the store from wherever they are, then the ring is allocated and the
    resident parts are moved to ``device``. ``load_peak_bytes`` is what the device holds
    once loaded (resident + ring), the most it held during the load besides one weight
    at a time while CUDA int4 layers were packed (see ``quantize_model``'s
    ``target_device``).
    """

    def __init__(self, model: nn.Module, config: OffloadConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.layers = decoder_layers(model)
        self.num_layers = len(self.layers)
        self.is_cuda = device.type == "cuda"
        pin = config.pin_memory and self.is_cuda
        self.prefetch = min(config.prefetch, self.num_layers - 1)
        self.num_buffers = self.prefetch + 1
        self._bindings: list[list[_Binding]] = []
        self._layouts: list[list[TensorSlot]] = []
        self.layer_bytes: list[int] = []
        self._closed = False
        # what stays on the device once loaded (it may still be on the host now; recounted
        # on the device below)
        self.resident_bytes = _storage_bytes(_resident_tensors(model, self.layers))
        self.store: WeightStore = (
            NvmeStore(self.num_layers, config.path)
            if config.device == "nvme"
            else HostStore(self.num_layers, pin)
        )
        self._offload_layers()  # layers -> store; their own tensors are dropped
        self.buffer_bytes = max(self.layer_bytes)
        self._check_budget()  # before the device gets anything
        self._make_ring(pin)
        _move_resident(model, self.layers, device)
        self.resident_bytes = _storage_bytes(_resident_tensors(model, self.layers), device)
        # device bytes once loaded, counted from the tensors themselves
        self.load_peak_bytes = _storage_bytes(
            [*_resident_tensors(model, self.layers), *self.ring], device
        )
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardspeed-offload")
        self._copy_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self._ready = [torch.cuda.Event() if self.is_cuda else None for _ in self.ring]
        self._free = [torch.cuda.Event() if self.is_cuda else None for _ in self.ring]
        # fetches in flight, oldest first: (layer, ring index, future)
        self._queue: deque[tuple[int, int, Future[None]]] = deque()
        self._num_fetches = 0
        self._next_layer = 0
        self._running: int | None = None  # ring index of the layer computing now
        self._hooks = []
        for i, layer in enumerate(self.layers):
            self._hooks.append(layer.register_forward_pre_hook(self._make_pre_hook(i)))
            self._hooks.append(layer.register_forward_hook(self._make_post_hook()))
        self._log_summary()

    # ------------------------------------------------------------------ setup
    def _make_ring(self, pin: bool) -> None:
        """Allocate the device ring and point every layer at it (the old copies are freed)."""
        # ring[r]: (buffer_bytes,) uint8 on device; _views[i][r]: layer i's tensors in ring[r]
        self.ring = [
            torch.empty(self.buffer_bytes, dtype=torch.uint8, device=self.device)
            for _ in range(self.num_buffers)
        ]
        self._views = [
            [[s.view(buf) for s in layout] for buf in self.ring] for layout in self._layouts
        ]
        # where a fetch's bytes land before the device copy: page-locked host buffers for
        # NVMe reads on CUDA; on CPU the ring itself (reads go straight into it)
        needs_staging = self.is_cuda and self.config.device == "nvme"
        self._staging = [
            host_buffer(self.buffer_bytes, pin) if needs_staging else buf for buf in self.ring
        ]
        for i in range(self.num_layers):
            self._bind(i, i % self.num_buffers)
        if self.is_cuda:
            torch.cuda.empty_cache()  # hand the layers' old device blocks back

    def _offload_layers(self) -> None:
        """Pack each layer into a host image (one layer at a time) and hand it to the store.

        The layer's own tensors are then replaced by empty placeholders (until the ring
        binds them), so its memory (host or device) is freed layer by layer.
        """
        owner: dict[int, int] = {}
        for i, layer in enumerate(self.layers):
            bindings, tensors = _layer_tensors(layer)
            for t in tensors:
                if owner.setdefault(id(t), i) != i:
                    raise ValueError(
                        f"EngineConfig.offload: decoder layers {owner[id(t)]} and {i} share a "
                        "tensor; offload supports layers whose tensors are their own."
                    )
            layout, nbytes = plan_layout([(tuple(t.shape), t.dtype) for t in tensors])
            image = host_buffer(nbytes, pin=False)  # one layer of host RAM at a time
            pack_image(tensors, layout, image)
            self.store.put(i, image)
            del tensors, image
            _release(bindings)
            self._bindings.append(bindings)
            self._layouts.append(layout)
            self.layer_bytes.append(nbytes)

    # ------------------------------------------------------------------ accounting
    @property
    def ring_bytes(self) -> int:
        """Device bytes of the layer ring (``num_buffers`` x the largest layer image)."""
        return self.num_buffers * self.buffer_bytes

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of all decoder-layer images kept in the store."""
        return sum(self.layer_bytes)

    @property
    def device_weight_bytes(self) -> int:
        """Weights on the device: resident tensors + the ring."""
        return self.resident_bytes + self.ring_bytes

    def kv_cache_memory(
        self, kv_cache_memory: int | float | None, num_blocks: int | None
    ) -> int | float | None:
        """The engine's KV budget under ``budget_bytes``: what the weights leave when the
        user gave no KV size; a given byte size is checked against the budget."""
        budget = self.config.budget_bytes
        if budget is None:
            return kv_cache_memory
        left = budget - self.device_weight_bytes
        if num_blocks is None and kv_cache_memory is None:
            return left
        if isinstance(kv_cache_memory, int) and kv_cache_memory > left:
            raise ValueError(
                f"EngineConfig.kv_cache_memory={kv_cache_memory} B does not fit "
                f"offload['budget_bytes']={budget}: weights on the device take "
                f"{self.device_weight_bytes} B, leaving {left} B; lower kv_cache_memory "
                "or raise budget_bytes."
            )
        return kv_cache_memory

    def _check_budget(self) -> None:
        budget = self.config.budget_bytes
        if budget is not None and self.device_weight_bytes >= budget:
            self.store.close()
            raise ValueError(
                f"EngineConfig.offload['budget_bytes']={budget} is too small: resident weights "
                f"({self.resident_bytes} B) + {self.num_buffers} layer buffers of "
                f"{self.buffer_bytes} B = {self.device_weight_bytes} B, with nothing left for "
                "the KV cache; lower 'prefetch' or raise 'budget_bytes'."
            )

    def _log_summary(self) -> None:
        mib = 2**20
        logger.info(
            "weight offload (%s): %d layers, %.1f MiB streamed (%.2f MiB each at most); "
            "device keeps %.1f MiB resident + ring of %d x %.2f MiB (prefetch=%d)",
            self.config.device, self.num_layers, self.offloaded_bytes / mib,
            self.buffer_bytes / mib, self.resident_bytes / mib, self.num_buffers,
            self.buffer_bytes / mib, self.prefetch,
        )  # fmt: skip

    # ------------------------------------------------------------------ streaming
    def _bind(self, layer: int, ring_index: int) -> None:
        """Point layer ``layer``'s parameters and buffers at ring buffer ``ring_index``."""
        for b, view in zip(self._bindings[layer], self._views[layer][ring_index]):
            if b.is_param:
                b.module._parameters[b.name].data = view
            else:
                b.module._buffers[b.name] = view

    def _fetch(self, layer: int, r: int) -> None:
        """Worker thread: fill ring buffer ``r`` with layer ``layer``'s image."""
        dst = self.ring[r]
        if not self.is_cuda:
            src = self.store.read(layer, self._staging[r])
            if src.data_ptr() != dst.data_ptr():
                dst[: src.numel()].copy_(src)
            return
        ready, free = self._ready[r], self._free[r]
        ready.synchronize()  # the staging buffer's previous H2D copy is done
        src = self.store.read(layer, self._staging[r])
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(free)  # the layer that used dst has finished
            dst[: src.numel()].copy_(src, non_blocking=True)
            ready.record(self._copy_stream)

    def _issue(self, layer: int) -> None:
        r = self._num_fetches % self.num_buffers
        self._num_fetches += 1
        self._queue.append((layer, r, self._worker.submit(self._fetch, layer, r)))
        self._next_layer = (layer + 1) % self.num_layers

    def _drain(self) -> None:
        """Finish every fetch in flight and all device work (after an out-of-order call)."""
        while self._queue:
            self._queue.popleft()[2].result()
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def _before_layer(self, i: int) -> None:
        if self._queue and self._queue[0][0] != i:
            logger.debug("offload: layer %d called out of order; restarting prefetch", i)
            self._drain()
        if not self._queue:
            self._issue(i)
        _, r, future = self._queue.popleft()
        future.result()  # re-raises a failed read
        if self.is_cuda:
            torch.cuda.current_stream(self.device).wait_event(self._ready[r])
        self._bind(i, r)
        self._running = r
        while len(self._queue) < self.prefetch:
            self._issue(self._next_layer)

    def _after_layer(self) -> None:
        if self.is_cuda and self._running is not None:
            self._free[self._running].record(torch.cuda.current_stream(self.device))
        self._running = None

    def _make_pre_hook(self, i: int):
        def hook(module: nn.Module, args: tuple) -> None:
            self._before_layer(i)

        return hook

    def _make_post_hook(self):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            self._after_layer()

        return hook

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran: the layers no longer stream (do not run the model)."""
        return self._closed

    def close(self) -> None:
        """Remove the hooks, stop the worker and release the store (files, host memory).

        Idempotent. The decoder layers are left pointing at stale ring buffers, so the
        model must not run afterwards.
        """
        if self._closed:
            return
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        try:
            self._drain()
        finally:
            self._worker.shutdown(wait=True)
            self.store.close()


def enable_weight_offload(
    model: nn.Module, offload: OffloadConfig | dict | None, device: torch.device
) -> LayerStreamer | None:
    """Stream ``model``'s decoder layers from ``offload``'s store; None when disabled."""
    config = OffloadConfig.parse(offload)
    if config is None:
        return None
    return LayerStreamer(model, config, device)


def _model_tensors(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def _resident_tensors(model: nn.Module, layers: nn.ModuleList) -> list[torch.Tensor]:
    streamed = {id(t) for layer in layers for t in _layer_tensors(layer)[1]}
    return [t for t in _model_tensors(model) if id(t) not in streamed]


def _storage_bytes(tensors: list[torch.Tensor], device: torch.device | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` that live on ``device``'s type
    (None: on any real device, i.e. not ``meta``)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        kind = t.device.type
        if kind == "meta" or (device is not None and kind != device.type):
            continue
        storage = t.untyped_storage()
        seen[(kind, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def _release(bindings: list[_Binding]) -> None:
    """Point each bound parameter/buffer at an empty tensor, freeing its storage (the
    ring binds real views later)."""
    for b in bindings:
        table = b.module._parameters if b.is_param else b.module._buffers
        old = table[b.name]
        assert old is not None
        empty = torch.empty(0, dtype=old.dtype, device=old.device)
        if b.is_param:
            old.data = empty
        else:
            table[b.name] = empty


def _move_resident(model: nn.Module, layers: nn.ModuleList, device: torch.device) -> None:
    """Move every parameter and buffer outside ``layers`` to ``device`` in place
    (``Parameter`` objects are kept, so tied weights stay tied)."""
    streamed = {id(m) for m in layers.modules()}
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(old buffer) -> (old, new)
    for module in model.modules():
        if id(module) in streamed:
            continue
        for p in module._parameters.values():
            if p is not None:
                p.data = p.data.to(device)  # a no-op for one already there (tied weights)
        for name, b in module._buffers.items():
            if b is not None:
                if id(b) not in moved:
                    moved[id(b)] = (b, b.to(device))
                module._buffers[name] = moved[id(b)][1]

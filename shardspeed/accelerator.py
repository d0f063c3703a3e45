"""Accelerator abstraction: which device and collective backend this process uses.

DeepSpeed's accelerator interface (``deepspeed/accelerator/abstract_accelerator.py``) for
the two device families ShardSpeed runs on: CUDA when present, otherwise the CPU with the
gloo backend. On the CPU each method answers as DeepSpeed's CPU accelerator does (one
device, no streams or events, seeds through ``torch.manual_seed``); the memory counters
report the device allocator (0 on the CPU) and ``total_memory`` the host.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ACCELERATOR_LIST = ("cuda", "cpu")


@dataclass(frozen=True)
class Accelerator:
    """The device family this process computes on."""

    name: str  # "cuda" or "cpu"

    def device_name(self, index: int | None = None) -> str:
        if self.name == "cpu" or index is None:
            return self.name
        return f"{self.name}:{index}"

    def current_device_name(self) -> str:
        if self.name == "cuda":
            return f"cuda:{torch.cuda.current_device()}"
        return "cpu"

    def device(self, local_rank: int = 0) -> torch.device:
        if self.name == "cuda":
            return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
        return torch.device("cpu")

    def set_device(self, local_rank: int) -> None:
        if self.name == "cuda":
            torch.cuda.set_device(local_rank % torch.cuda.device_count())

    def communication_backend_name(self) -> str:
        return "nccl" if self.name == "cuda" else "gloo"

    def is_available(self) -> bool:
        return self.name == "cpu" or torch.cuda.is_available()

    def is_bf16_supported(self) -> bool:
        if self.name == "cuda":
            return torch.cuda.is_bf16_supported()
        return True

    def is_fp16_supported(self) -> bool:
        return True

    def synchronize(self) -> None:
        if self.name == "cuda":
            torch.cuda.synchronize()

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.name == "cuda" else 0

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated() if self.name == "cuda" else 0

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory() if self.name == "cuda" else tensor

    # -- device --------------------------------------------------------------------------
    def _cuda(self) -> bool:
        return self.name == "cuda"

    def is_synchronized_device(self) -> bool:
        return not self._cuda()

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def current_device(self) -> int:
        """The device index (CUDA), or the local rank (CPU, as DeepSpeed)."""
        if self._cuda():
            return torch.cuda.current_device()
        return int(os.environ.get("LOCAL_RANK", 0))

    def device_count(self) -> int:
        """CUDA devices, or the processes on this host (``LOCAL_SIZE``/``LOCAL_WORLD_SIZE``,
        1 when unset) for the CPU."""
        if self._cuda():
            return torch.cuda.device_count()
        return int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)

    def is_fp64_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float]
        if self.is_fp16_supported():
            dtypes.append(torch.half)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def is_triton_supported(self) -> bool:
        return False

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        if self._cuda():
            return torch.cuda._lazy_call(callback)
        return callback()

    # -- random number generators --------------------------------------------------------
    def random(self) -> Any:
        return torch.random

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if not self._cuda():
            torch.set_rng_state(new_state)
        elif device_index is None:
            torch.cuda.set_rng_state(new_state)
        else:
            torch.cuda.set_rng_state(new_state, device_index)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if not self._cuda():
            return torch.get_rng_state()
        if device_index is None:
            return torch.cuda.get_rng_state()
        return torch.cuda.get_rng_state(device_index)

    def manual_seed(self, seed: int) -> Any:
        return torch.cuda.manual_seed(seed) if self._cuda() else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.cuda.manual_seed_all(seed) if self._cuda() else torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda() else torch.initial_seed()

    def default_generator(self, device_index: int) -> torch.Generator:
        if self._cuda():
            return torch.cuda.default_generators[device_index]
        return torch.default_generator

    # -- streams, events and graphs (none on the CPU) ------------------------------------
    @property
    def Stream(self) -> Any:  # noqa: N802 (DeepSpeed's name)
        return torch.cuda.Stream if self._cuda() else None

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream) if self._cuda() else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index) if self._cuda() else None

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index) if self._cuda() else None

    @property
    def Event(self) -> Any:  # noqa: N802 (DeepSpeed's name)
        return torch.cuda.Event if self._cuda() else None

    def is_current_stream_capturing(self) -> bool:
        return self._cuda() and torch.cuda.is_current_stream_capturing()

    def create_graph(self) -> Any:
        return torch.cuda.CUDAGraph() if self._cuda() else None

    def capture_to_graph(
        self, graph: Any, pool: Any = None, stream: Any = None
    ) -> contextlib.AbstractContextManager[Any]:
        if self._cuda():
            return torch.cuda.graph(graph, pool, stream)
        return contextlib.nullcontext()

    def replay_graph(self, graph: Any) -> None:
        if self._cuda():
            graph.replay()

    # -- memory --------------------------------------------------------------------------
    def empty_cache(self) -> None:
        if self._cuda():
            torch.cuda.empty_cache()

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        if self._cuda():
            torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda() else 0

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._cuda() else 0

    def memory_cached(self, device_index: int | None = None) -> int:
        return self.memory_reserved(device_index)

    def max_memory_cached(self, device_index: int | None = None) -> int:
        return self.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        self.reset_max_memory_allocated(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        return torch.cuda.memory_stats(device_index) if self._cuda() else {}

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda():
            torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda():
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        if self._cuda():
            return torch.cuda.mem_get_info(device_index)[0]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._cuda() else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this accelerator's device family."""
        return tensor.device.type == self.name

    # -- profiler ranges -----------------------------------------------------------------
    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        if self._cuda():
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: Any = None) -> None:
        if self._cuda():
            torch.cuda.nvtx.range_pop()

    # -- tensor types and environment ----------------------------------------------------
    def _tensor_type(self, name: str) -> Any:
        return getattr(torch.cuda if self._cuda() else torch, name)

    BFloat16Tensor = property(lambda self: self._tensor_type("BFloat16Tensor"))
    ByteTensor = property(lambda self: self._tensor_type("ByteTensor"))
    DoubleTensor = property(lambda self: self._tensor_type("DoubleTensor"))
    FloatTensor = property(lambda self: self._tensor_type("FloatTensor"))
    HalfTensor = property(lambda self: self._tensor_type("HalfTensor"))
    IntTensor = property(lambda self: self._tensor_type("IntTensor"))
    LongTensor = property(lambda self: self._tensor_type("LongTensor"))

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"] if self._cuda() else []

    def set_visible_devices_envs(
        self, current_env: dict[str, str], local_accelerator_ids: list[int]
    ) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def export_envs(self) -> list[str]:
        return ["NCCL"] if self._cuda() else []

    def get_compile_backend(self) -> str:
        return "inductor"


def get_accelerator() -> Accelerator:
    """The accelerator for this process; ``SHARDSPEED_ACCELERATOR=cpu|cuda`` overrides."""
    forced = os.environ.get("SHARDSPEED_ACCELERATOR") or os.environ.get("DS_ACCELERATOR")
    if forced:
        if forced not in ("cpu", "cuda"):
            raise ValueError(
                f"SHARDSPEED_ACCELERATOR={forced!r} is not supported; use 'cpu' or 'cuda'."
            )
        return Accelerator(forced)
    return Accelerator("cuda" if torch.cuda.is_available() else "cpu")


def is_current_accelerator_supported() -> bool:
    """Whether this process's accelerator is one ShardSpeed supports (DeepSpeed's check)."""
    return get_accelerator().device_name() in SUPPORTED_ACCELERATOR_LIST

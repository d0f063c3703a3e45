"""Engine configuration (one dataclass, validated once)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from shardspeed.inference.fastgen.attention import ATTENTION_BACKENDS
from shardspeed.inference.fastgen.offload_config import OffloadConfig
from shardspeed.inference.fastgen.scheduler import SCHEDULER_POLICIES
from shardspeed.inference.fastgen.speculative.config import SpeculativeConfig

PIPELINE_SCHEDULES = ("inflight", "naive")  # see EngineConfig.pipeline_schedule


@dataclass
class EngineConfig:
    """Knobs of :class:`~shardspeed.inference.fastgen.engine.InferenceEngine`.

    Attributes:
        block_size: token slots per KV block; None => 16 on CPU, 64 on CUDA.
        num_blocks: KV blocks to allocate; None => from ``kv_cache_memory``.
        kv_cache_memory: KV budget as bytes (int) or a fraction (0, 1] of free
            device memory (host ``available`` memory on CPU). With both None the
            budget is 0.9 of free CUDA memory or 0.1 of available host memory (at
            most 4 GiB); any fraction is capped at ``max_ragged_sequence_count *
            max_seq_len`` tokens (see ``kv_cache.resolve_num_blocks``).
        max_ragged_batch_size: token budget of one forward (all sequences together).
        max_ragged_sequence_count: most sequences in one forward.
        max_seq_len: prompt + generated tokens per request; None => model's maximum.
        scheduler: ``"splitfuse"`` | ``"prefill_first"`` | ``"static"``.
        enable_prefix_caching: reuse KV blocks of identical prompt prefixes.
        dtype: weights/KV dtype (``torch.dtype`` or name); None => checkpoint's
            (fp16 checkpoints run in fp32 on CPU).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; None => the accelerator.
        attention_backend: ``"auto"`` | ``"torch"`` | ``"cpu"`` | ``"flash"`` (``"auto"``: flash
            on CUDA where it applies, the native CPU decode kernel on CPU where it builds).
        watermark: fraction of blocks kept free when admitting new prompts while
            others run (fewer preemptions).
        quantization: weight-only quantization of the model's linear layers after
            load: ``"int8"``, ``"int4"``, ``"int4-g64-asym"``..., a dict of
            :class:`~shardspeed.inference.quantization.WeightQuantConfig` fields or
            such a config; None keeps the weights in ``dtype``.
        compile_decode: decode-only steps through a static-shape compiled step
            (see :mod:`~shardspeed.inference.fastgen.compiled_decode`): True =>
            CUDA graphs on CUDA, ``torch.compile`` on CPU (error if the model
            cannot take the path); ``"compile"`` / ``"cuda_graph"`` explicitly;
            False or None (auto) => eager (the CPU compile costs ~10 s, minutes
            on a loaded machine; docs/inference.md has the measurements).
        offload: ZeRO-Inference weight offload (None => weights stay on ``device``):
            ``{"device": "cpu" | "nvme", "path": dir (nvme), "prefetch": 1,
            "pin_memory": True, "budget_bytes": None}`` or an
            :class:`~shardspeed.inference.fastgen.offload_config.OffloadConfig`; decoder
            layers' weights live off the compute device and are streamed in ahead of
            use (see :mod:`~shardspeed.inference.fastgen.offload`).
        tensor_parallel: tensor-parallel degree; > 1 shards the model over that many
            ranks (the caller's process plus spawned workers), token-identical to 1.
        expert_parallel: expert-parallel degree of an MoE model; > 1 keeps
            ``num_experts / E`` experts per rank (dense parts replicated, tokens moved by
            all-to-all), token-identical to 1 (see
            :mod:`~shardspeed.inference.fastgen.expert_parallel`).
        expert_parallel_dispatch: how routed tokens move between expert ranks:
            ``"all_to_all"`` (dispatch / combine, DeepSpeed-MoE's) or ``"all_gather"``
            (one collective per layer: fewer round trips, more bytes).
        pipeline_parallel: pipeline stages; > 1 splits the layers over that many ranks
            (the caller's process is stage 0), token-identical to 1; with
            ``tensor_parallel=T`` each stage is ``T`` tensor-parallel ranks (``P x T`` in
            all; see :mod:`~shardspeed.inference.fastgen.pipeline_parallel`).
        pipeline_schedule: with ``pipeline_parallel > 1``: ``"inflight"`` keeps P
            micro-batches in flight (no stage waits in steady decoding); ``"naive"``
            runs one at a time (for comparison).
        kv_cache_dtype: ``"auto"`` (the KV in ``dtype``), ``"int8"`` or ``"fp8"``
            (e4m3, where torch has it): quantized KV with one fp16 scale per token
            and KV head, ~2x the tokens of a bf16 cache in the same memory (see
            :mod:`~shardspeed.inference.fastgen.kv_quant`); torch attention only.
        speculative_config: speculative decoding of decode steps (None => off): a
            dict of :class:`~shardspeed.inference.fastgen.speculative.SpeculativeConfig`
            fields, e.g. ``{"method": "ngram", "num_speculative_tokens": 4}`` or
            ``{"model": draft_dir, "num_speculative_tokens": 4}`` (vLLM's keys).
        enable_lora: serve PEFT LoRA adapters by name beside the base model, several in
            one batch (see :mod:`~shardspeed.inference.fastgen.lora`); single process,
            eager forward only.
        max_loras: adapters loaded at once (with ``enable_lora``).
        max_lora_rank: largest adapter rank accepted (with ``enable_lora``).
        cpu_prepack: pack ``nn.Linear`` weights once for oneDNN on CPU (see
            :mod:`~shardspeed.inference.fastgen.cpu_prepack`): None (auto) packs bf16/fp16
            weights (bitwise equal to ``F.linear``; on an AVX2 CPU without oneDNN kernels
            for them as an fp32 copy, multiplied in fp32: within one bf16/fp16 step, 3x the
            16-bit weight memory) and fp32 on AVX-512 and AVX2 CPUs (rounding differs by
            ~1e-6 relative), True every dtype, False never; the packed copies double the
            weight memory.
    """

    block_size: int | None = None
    num_blocks: int | None = None
    kv_cache_memory: int | float | None = None
    max_ragged_batch_size: int = 512
    max_ragged_sequence_count: int = 64
    max_seq_len: int | None = None
    scheduler: str = "splitfuse"
    enable_prefix_caching: bool = False
    dtype: torch.dtype | str | None = None
    device: str | None = None
    attention_backend: str = "auto"
    watermark: float = 0.01
    quantization: Any = None
    compile_decode: bool | str | None = None
    offload: Any = None
    tensor_parallel: int = 1
    expert_parallel: int = 1
    expert_parallel_dispatch: str = "all_to_all"
    pipeline_parallel: int = 1
    pipeline_schedule: str = "inflight"
    kv_cache_dtype: str = "auto"
    speculative_config: Any = None
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    cpu_prepack: bool | None = None

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Like the constructor, but an unknown key raises ``ValueError`` listing the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known options: {sorted(known)}.")
        return cls(**kwargs)

    def validate(self) -> None:
        def positive(name: str, value: int | None, allow_none: bool) -> None:
            if value is None and allow_none:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EngineConfig.{name}={value!r} must be an int >= 1.")

        positive("block_size", self.block_size, True)
        positive("num_blocks", self.num_blocks, True)
        positive("max_ragged_batch_size", self.max_ragged_batch_size, False)
        positive("max_ragged_sequence_count", self.max_ragged_sequence_count, False)
        positive("max_seq_len", self.max_seq_len, True)
        positive("tensor_parallel", self.tensor_parallel, False)
        positive("expert_parallel", self.expert_parallel, False)
        other = {"tensor_parallel": self.tensor_parallel,
                 "pipeline_parallel": getattr(self, "pipeline_parallel", 1)}  # fmt: skip
        for name, degree in other.items():
            if self.expert_parallel > 1 and degree > 1:
                raise ValueError(
                    f"EngineConfig.expert_parallel={self.expert_parallel} with {name}={degree} "
                    "is not supported yet (expert parallelism replicates the dense parts); use "
                    "one of the two."
                )
        positive("pipeline_parallel", self.pipeline_parallel, False)
        if self.scheduler not in SCHEDULER_POLICIES:
            raise ValueError(
                f"EngineConfig.scheduler={self.scheduler!r} is not supported; "
                f"choose one of {SCHEDULER_POLICIES}."
            )
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise ValueError(
                f"EngineConfig.pipeline_schedule={self.pipeline_schedule!r} is not supported; "
                f"choose one of {PIPELINE_SCHEDULES}."
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"EngineConfig.attention_backend={self.attention_backend!r} is not supported; "
                f"choose one of {ATTENTION_BACKENDS}."
            )
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"EngineConfig.watermark={self.watermark!r} must be in [0, 1).")
        if self.quantization is not None:
            from shardspeed.inference.quantization import WeightQuantConfig

            self.quantization = WeightQuantConfig.parse(self.quantization)
        self._validate_offload()
        self._validate_kv_cache_dtype()
        self._validate_lora()
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.speculative_config is not None:
            self.speculative_config.check_engine(self)

    def _validate_lora(self) -> None:
        """LoRA deltas are added by hooks in the single-process eager forward."""
        from shardspeed.inference.fastgen.lora.config_check import check_lora_config

        check_lora_config(self)

    def _validate_kv_cache_dtype(self) -> None:
        """A quantized KV cache is read by the single-process torch attention path only."""
        from shardspeed.inference.fastgen.kv_quant import storage_dtype

        if self.kv_cache_dtype == "auto":
            return
        storage_dtype(self.kv_cache_dtype)  # ValueError for unknown / unavailable dtypes
        for name, ok in (
            ("compile_decode", (None, False)),
            ("attention_backend", ("auto", "torch")),
            ("tensor_parallel", (1,)),
            ("expert_parallel", (1,)),
            ("pipeline_parallel", (1,)),
        ):
            value = getattr(self, name)
            if value not in ok:
                raise ValueError(
                    f"EngineConfig.kv_cache_dtype={self.kv_cache_dtype!r} cannot be combined with "
                    f"{name}={value!r} yet (only the single-process torch attention path reads a "
                    f"quantized cache); use {name}={ok[0]!r} or kv_cache_dtype='auto'."
                )
        self.attention_backend = "torch"

    def _validate_offload(self) -> None:
        """Parse ``offload`` into an :class:`OffloadConfig` (None when disabled)."""
        self.offload = OffloadConfig.parse(self.offload)
        if self.offload is None:
            return
        if self.compile_decode not in (None, False):
            raise ValueError(
                f"EngineConfig.offload={self.offload.device!r} cannot be combined with "
                f"compile_decode={self.compile_decode!r} (a compiled step keeps the weights' "
                "device addresses, offload reuses them per layer); set compile_decode=False."
            )
        if self.tensor_parallel > 1:
            raise ValueError(
                f"EngineConfig.offload={self.offload.device!r} with tensor_parallel="
                f"{self.tensor_parallel} is not supported yet; use tensor_parallel=1 or no offload."
            )

    def resolved_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        from shardspeed.accelerator import get_accelerator

        if get_accelerator().name == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
